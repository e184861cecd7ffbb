"""Streaming local SGD and DiLoCo: the model synced one fragment at a time, each sync hidden behind inner steps.

Plain local SGD (:mod:`distopt.modes.local_sgd`) sends the whole model's
pseudo-gradient every ``sync_every``-th step, and every rank waits for it: the
network idles for H - 1 steps and is the bottleneck for one. Streaming DiLoCo
(Douillard et al. 2025, arXiv 2501.18512) spreads and hides that sync:

- the trainable parameters are cut into ``sync_fragments`` (F) contiguous
  fragments of about equal bytes (:mod:`distopt.planning.fragments`), each kept
  in packs of its own by the engine;
- fragment ``f`` sends its pseudo-gradient ``anchor - param`` after every local
  step ``s`` with ``(s - offset_f) % H == 0``, offsets spread evenly over the
  period (:mod:`distopt.planning.schedule`): one fragment at a time, so a sync
  puts about 1/F of the model on the wire;
- the exchange travels while the next ``sync_overlap`` (tau) inner steps run, and
  is *merged* after the tau-th: the fragment's anchors move by the mean (plain
  averaging) or the outer optimizer steps on them (DiLoCo, one fragment's anchors
  at a time), and the parameters become
  ``sync_mixing * local + (1 - sync_mixing) * global`` (:mod:`distopt.planning.mixing`).

F = 1 with tau = 0 (and mixing 0) is plain ``sync_every``, bit for bit.

This is the implementation; the user asks for it with ``fragments=``, ``overlap=`` or ``mixing=``
of :class:`distopt.LocalSGD` or :class:`distopt.DiLoCo` (:mod:`distopt.modes.diloco`), or with
the ``sync_fragments=`` shorthands.

The exchanges go through the engine's packs and plan, one subset of packs at a
time (:meth:`distopt.engine.GradientEngine.launch_partial`), so compression and
the control flags apply to them as to any exchange, and every rank issues the
same collectives in the same order: the schedule is a function of the step count.

**join.** A rank that runs out of data first waits for its fragments in flight
and merges them, then sends each fragment's progress since its last sync once
more, as a contributor, in the others' next F exchanges (all launched at once,
in the order the schedule launches them), their flags saying that it contributes
for the last time; then it shadows the others' exchanges, fragment by fragment,
with zeros. These last exchanges take the global values whatever ``sync_mixing``
is: the end of a join block is a full sync. The ranks still training learn that a
rank has joined only from an exchange's flags, so a collective of their own (the
drift check) runs only right after a step that sends a fragment, once that
fragment's exchange is back (:meth:`StreamingMode.ranks_training`).

**Fault tolerance** (``fault_tolerance=manager``, :mod:`distopt.fault_tolerance`). Each
fragment's sync is a quorum of the replicas and a commit vote, as a whole-model sync is
in plain local SGD, and one sync is in flight at a time (``sync_overlap`` at most the
steps between two launches: torchft's Manager holds one quorum at a time). The quorum
is waited for as the sync launches, and the fragment it sends is chosen by the quorum's
committed step count (``quorum_step % F``), not by the local step: a replacement that
joins knows nothing of the others' schedule, but learns the count from the quorum, and so
sends the same fragment as they do. A process's first local step launches a sync (where a
fresh job's replicas take the primary's state, and a replacement heals from a live peer);
the commit vote comes when the sync is merged, ``sync_overlap`` steps later, and a replica
that heals there takes its peer's state as it was at the quorum, with the step count moved
on by the steps since. A sync voted down moves no anchor: the fragment's parameters go
back to their anchors, alike on every replica, as torchft's streaming DiLoCo restores its
fragment, and the fragment is sent again at the next launch.

**Checkpoints.** ``state_dict()`` waits for the exchanges in flight (their
communication only: nothing is merged early) and saves each one's mean
pseudo-gradient and the step it was sent at; a load puts them back, to be merged
at their step, so that a resumed run goes on bit for bit.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch.optim import Optimizer

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives
from ..engine.partial import PartialExchange
from ..planning import drift
from ..planning.fragments import split_fragments
from ..planning.schedule import StreamSchedule
from ..transport import stalls
from .base import ModeContext, OuterFactory, SyncVote
from .local_sgd import STATE_KEY, LocalSGDMode, last_contribution

__all__ = ["StreamingMode", "STREAMING_KEY"]

#: Within ``state_dict()[STATE_KEY]``: the exchanges sent and not merged yet.
STREAMING_KEY = "streaming"


@dataclass
class _Sync:
    """One fragment's sync, sent and not merged yet."""

    launched: int  # the local step it was sent after
    exchange: Optional[PartialExchange]  # its exchange (None: values known already)
    # (parameter, mean pseudo-gradient, None where no rank sent one)
    values: List[Tuple[Tensor, Optional[Tensor]]] = field(default_factory=list)


class StreamingMode(LocalSGDMode):
    """Local SGD / DiLoCo synced in fragments on staggered schedules, each sync overlapped with inner steps.

    Args:
        sync_every: local steps between two syncs of a fragment (H).
        outer_optimizer: builds the outer optimizer (DiLoCo) from the anchors; None averages.
        local_warmup: synchronous steps before the first local one (W).
        fragments: fragments (F, at most H).
        overlap: inner steps a fragment's sync travels before it is merged (tau, less than H).
        mixing: the local parameters' weight in the merge (alpha, in [0, 1]).
    """

    def __init__(self, sync_every: int, outer_optimizer: Optional[OuterFactory], local_warmup: int,
                 fragments: int = 1, overlap: int = 0, mixing: float = 0.0) -> None:
        super().__init__(sync_every, outer_optimizer, local_warmup)
        self.fragments = fragments
        self.overlap = overlap
        self.mixing = mixing
        self._pending: Dict[int, _Sync] = {}  # fragment -> its sync in flight (or arrived, not merged)
        self._plan: Optional[List[Any]] = None  # the engine's packs the fragments were read from
        self._shadow_warm = 0  # a joined rank: gradient rounds of the others' warm-up still to shadow
        self._shadow_cycle: List[int] = []  # then the fragments, in the order the others send them
        self._shadow_next = 0
        self._sent_now: List[PartialExchange] = []  # the exchanges sent in the last step

    # ------------------------------------------------------------------ the seam

    def settings(self) -> Dict[str, Any]:
        return {**super().settings(), "sync_fragments": self.fragments, "sync_overlap": self.overlap,
                "sync_mixing": self.mixing}

    def check_compatible(self, *, optimizer: Optimizer, reduce_op: str, bcast_period: int,
                         fault_tolerant: bool) -> None:
        super().check_compatible(optimizer=optimizer, reduce_op=reduce_op, bcast_period=bcast_period,
                                 fault_tolerant=fault_tolerant)
        schedule = StreamSchedule(self.sync_every, self.fragments, self.overlap)
        if fault_tolerant and self.overlap > schedule.gap():
            every, fragments, overlap = self.named("every"), self.named("fragments"), self.named("overlap")
            raise ValueError(
                f"with fault_tolerance, streaming local SGD keeps one fragment's sync in flight at a time (each sync "
                f"is a quorum and a commit vote, and torchft's Manager holds one quorum at a time), so {overlap} must "
                f"be at most the {schedule.gap()} local steps between two launches ({every}={self.sync_every}, "
                f"{fragments}={self.fragments}); got {overlap}={self.overlap}. Lower {overlap} or {fragments}, or "
                f"raise {every}"
            )

    def attach(self, ctx: ModeContext) -> None:
        super().attach(ctx)
        ctx.engine.set_fragments(self.fragments)
        ctx.engine.set_shadow_fragment(self._shadow_fragment)
        self._plan = ctx.engine.packs

    def schedule(self, ctx: ModeContext) -> StreamSchedule:
        """The schedule over the fragments there are (fewer than F when fewer parameters are trainable)."""
        return StreamSchedule(self.sync_every, max(1, min(self.fragments, len(self._fragments(ctx)))), self.overlap)

    def local_step(self, ctx: ModeContext) -> int:
        """Local steps taken, counting the one being taken inside ``step()``."""
        return ctx.steps + 1 - self.local_warmup

    def _after_local_step(self, ctx: ModeContext) -> None:
        self._sent_now = []
        self.since_sync += 1
        if not self._needs_anchors(ctx):  # plain averaging over one rank changes nothing
            return
        if self._vote is not None:
            self._after_replicated_step(ctx, self._vote)
            return
        step = self.local_step(ctx)
        schedule = self.schedule(ctx)
        # The syncs sent tau steps ago (schedule.merges(step), and any loaded from a checkpoint).
        for f in self._in_flight():
            if self._pending[f].launched + self.overlap <= step:
                self._merge(ctx, f)
        for f in self._in_flight():
            exchange = self._pending[f].exchange
            if exchange is not None:  # a compressor's later stages travel during inner steps too
                ctx.engine.advance_partial(exchange)
        for f in schedule.launches(step):
            self._follow_plan(ctx)
            self._complete_stages(ctx)
            self._send(ctx, f, step)
            self.since_sync = 0
            if not self.overlap:
                self._merge(ctx, f)

    def _after_replicated_step(self, ctx: ModeContext, vote: SyncVote) -> None:
        """Fault tolerance: merge the sync in flight when its overlap is over, then launch the next one
        at a launch step (or at once, before this process's first sync), its fragment the quorum's."""
        for f in self._in_flight():
            if self._pending[f].launched + self.overlap <= self.local_step(ctx):
                self._merge(ctx, f)
        for f in self._in_flight():
            exchange = self._pending[f].exchange
            if exchange is not None:
                ctx.engine.advance_partial(exchange)
        step = self.local_step(ctx)  # a heal in the merge moved it on
        schedule = self.schedule(ctx)
        if self._pending or not (schedule.launches(step) or not self._joined):
            return
        self._follow_plan(ctx)
        vote.enter_round()  # the quorum: who takes part, and the committed count that picks the fragment
        fragment = vote.quorum_step % schedule.fragments
        self._send(ctx, fragment, step)
        self.since_sync = 0
        if not self.overlap:
            self._merge(ctx, fragment)

    # ------------------------------------------------------------------ fragments and their syncs

    def _fragments(self, ctx: ModeContext) -> List[List[Tensor]]:
        """Each fragment's parameters: read from the engine's packs (a world of one: cut here alike)."""
        engine = ctx.engine
        if self._exchanges(ctx):
            return [[p for k in packs for p in engine.packs[k].params] for packs in engine.exchange.fragment_packs]
        params = [p for p, _ in self._pairs(ctx)]
        runs = split_fragments([p.numel() * p.element_size() for p in params], self.fragments)
        return [[params[i] for i in run] for run in runs]

    def _follow_plan(self, ctx: ModeContext) -> None:
        """The engine re-planned (parameters added or unfrozen): merge the syncs in flight now, on every
        rank alike, before any fragment of the new plan is sent."""
        if ctx.engine.packs is self._plan:
            return
        self._merge_all(ctx)
        self._plan = ctx.engine.packs

    def _send(self, ctx: ModeContext, fragment: int, step: int) -> None:
        """Send ``fragment``'s pseudo-gradient; it stays in flight until merged."""
        if not self._exchanges(ctx):  # DiLoCo in one process: the mean is this rank's own
            with torch.no_grad():
                values = [(p, self._pseudo_gradient_alone(p)) for p in self._fragments(ctx)[fragment]]
            self._pending[fragment] = _Sync(step, None, values)
            return
        engine = ctx.engine
        if engine.progress is not None:
            engine.progress.phase = f"inside step() (streaming local SGD: sending fragment {fragment})"
        with torch.no_grad():
            exchange = engine.launch_partial(engine.exchange.fragment_packs[fragment], self._filler(ctx))
        self._pending[fragment] = _Sync(step, exchange)
        self._sent_now.append(exchange)

    def _merge(self, ctx: ModeContext, fragment: int, final: bool = False) -> None:
        """Apply ``fragment``'s sync: wait for it, move its anchors, mix its parameters.

        Args:
            final: the last sync of a rank leaving (join): the parameters take the global values.
        """
        sync = self._pending.pop(fragment)
        if sync.exchange is not None:
            if ctx.engine.progress is not None:
                ctx.engine.progress.phase = f"inside step() (streaming local SGD: merging fragment {fragment})"
            ctx.engine.finish_partial(sync.exchange)
        alpha = 0.0 if final else self.mixing
        if self._vote is not None:
            since = self.local_step(ctx) - sync.launched
            committed = self._vote.commit()  # may heal: the anchors are read after it
            if self._vote.healed_now:  # the peer's state is the one it had at the quorum, `since` steps ago
                ctx.set_steps(ctx.steps + since)
            # Healed, even in a sync voted down, this replica holds its peers' state and schedule.
            self._joined = self._joined or committed or self._vote.healed_now
            if not committed:  # the fragment goes back to its anchors, alike on every replica (as torchft's)
                with torch.no_grad():
                    for p, _ in self._arrived(sync):
                        p.copy_(self._anchor_of(p))
                return
        with torch.no_grad():
            self._apply([(p, self._anchor_of(p), mean) for p, mean in self._arrived(sync)], alpha)

    def _arrived(self, sync: _Sync) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """``(parameter, mean pseudo-gradient)`` of a sync that has arrived, None where no rank sent one."""
        if sync.exchange is None:
            return sync.values
        return [item for pack, _, views in sync.exchange.held for item in self._received(pack, views)]

    def _exchanges(self, ctx: ModeContext) -> bool:
        """Whether syncs travel (more than one rank, or replicas under fault tolerance, however many)."""
        return ctx.world_size > 1 or self._vote is not None

    def _complete_stages(self, ctx: ModeContext) -> None:
        """Before another exchange is sent: every compressor stage of those in flight, issued and back.

        A codec's later stages are issued as earlier ones come back. Were they issued after the
        next exchange's first, a rank that has joined (which shadows one exchange after the
        other) or one sending its last exchanges could not issue the same collectives in the
        same order. So at most one exchange, the last sent, has stages to come: its stages
        travel during the inner steps until the next fragment is sent.
        """
        for f in self._in_flight():
            exchange = self._pending[f].exchange
            if exchange is not None and exchange.staged():
                ctx.engine.arrive_partial(exchange)

    def _in_flight(self) -> List[int]:
        """The fragments whose sync is in flight (or arrived, not merged), in the order they were sent."""
        return sorted(self._pending, key=lambda f: self._pending[f].launched)

    def _merge_all(self, ctx: ModeContext) -> None:
        """Merge every sync in flight, in the order they were sent."""
        for fragment in self._in_flight():
            self._merge(ctx, fragment)

    # ------------------------------------------------------------------ join

    def sync_now(self, ctx: ModeContext) -> None:
        """Refused: streaming syncs each fragment at a step of its own, with its sync in flight for
        ``overlap`` steps, so no single point holds every fragment synced.

        Raises:
            RuntimeError: always, with what to do instead.
        """
        raise RuntimeError(
            f"sync_now() is not available in streaming local SGD / DiLoCo ({self.named('fragments')}="
            f"{self.fragments}): each fragment syncs at a step of its own, with its sync in flight for "
            "some steps, so the ranks never hold the whole model synced at one point. Between syncs the replicas' "
            "common state is each fragment's parameters at its last sync, which opt.state_dict() holds on every "
            "rank; or train without fragments (LocalSGD/DiLoCo) where a checkpoint must hold one replica for all")

    def leaving(self, ctx: ModeContext) -> Optional[Callable[[], None]]:
        engine = ctx.engine
        if ctx.world_size == 1:
            return None
        if not engine.exchange.local:  # in the warm-up: the others' remaining warm-up rounds, then their fragments
            self._shadow_warm = self.local_warmup - ctx.steps
            self._start_shadow_cycle(ctx, 0)
            return None
        self._shadow_warm = 0
        step = ctx.steps - self.local_warmup
        schedule = self.schedule(ctx)
        in_flight = bool(self._pending)
        self._merge_all(ctx)
        self._start_shadow_cycle(ctx, step)
        progress = any(step - (schedule.last_launch(f, step) or 0) for f in range(schedule.fragments))
        if not (in_flight or progress):  # nothing to send: shadow at once (plain sync_every's rule)
            return None
        # Every fragment once more, in the order the others will send them. One after the other, each
        # back (a compressor's stages too) before the next is sent, as the others complete the stages
        # of one before sending the next; the first is launched now, as a contributor.
        order = schedule.order_after(step)
        fill = self._filler(ctx)
        with torch.no_grad(), last_contribution(engine):
            first = engine.launch_partial(engine.exchange.fragment_packs[order[0]], fill)
        self.since_sync = 0

        def finish() -> None:
            exchanges = [first]
            for f in order[1:]:
                engine.arrive_partial(exchanges[-1])
                with torch.no_grad(), last_contribution(engine):
                    exchanges.append(engine.launch_partial(engine.exchange.fragment_packs[f], fill))
            for f, exchange in zip(order, exchanges):
                self._pending[f] = _Sync(step, exchange)
                self._merge(ctx, f, final=True)

        return finish

    def ranks_training(self, ctx: ModeContext) -> Optional[int]:
        """Right after a step that sent a fragment, what that exchange's flags say: it is waited for here
        (its communication only; it is merged at its own step), as every rank still training sent it in
        this step. After any other step None: a rank may have run out of data since the last exchange
        (a flag read at a merge is ``sync_overlap`` steps old), and sent its last exchanges unseen."""
        if not ctx.engine.exchange.local or not self._sent_now:
            return super().ranks_training(ctx)
        exchange = self._sent_now[-1]
        ctx.engine.arrive_partial(exchange)
        return ctx.engine.outcome.training if exchange.totals is None else exchange.totals.training

    def probe(self, ctx: ModeContext) -> Optional[int]:
        """The probe round sends zeros in the packs of the fragment the next exchange sends: a rank that has
        joined shadows that one now (in the warm-up, every pack: a gradient round)."""
        engine = ctx.engine
        if not engine.exchange.local or ctx.world_size == 1:
            return super().probe(ctx)
        return engine.probe(self.schedule(ctx).order_after(ctx.steps - self.local_warmup)[0]).training

    def _start_shadow_cycle(self, ctx: ModeContext, step: int) -> None:
        self._shadow_cycle = self.schedule(ctx).order_after(step)
        self._shadow_next = 0

    def _shadow_fragment(self) -> Optional[int]:
        """As a rank that has joined: the fragment the others send next (None: a gradient round, every pack)."""
        if self._shadow_warm > 0:
            self._shadow_warm -= 1
            return None
        if not self._shadow_cycle:
            return None
        fragment = self._shadow_cycle[self._shadow_next % len(self._shadow_cycle)]
        self._shadow_next += 1
        return fragment

    # ------------------------------------------------------------------ checkpoints and taking one rank's state

    def state_dict(self, ctx: ModeContext) -> Dict[str, Any]:
        """The local-SGD state dict, plus the syncs sent and not merged yet under :data:`STREAMING_KEY`.

        Their communication is waited for (nothing else: they are merged at their own step, after the save as
        without it), and each is saved as its fragment, the local step it was sent after, and the mean
        pseudo-gradient of each of its parameters (by index in the wrapper's parameter list).
        """
        out = super().state_dict(ctx)
        index = {id(p): i for i, p in enumerate(ctx.params)}
        pending = []
        for fragment in self._in_flight():
            sync = self._pending[fragment]
            if sync.exchange is not None:
                ctx.engine.arrive_partial(sync.exchange)
            values = self._arrived(sync)
            pending.append({"fragment": fragment, "launched": sync.launched,
                            "params": [index[id(p)] for p, _ in values],
                            "values": [None if mean is None else mean.detach().clone() for _, mean in values]})
        out[STATE_KEY][STREAMING_KEY] = {"pending": pending}
        return out

    def load_state_dict(self, ctx: ModeContext, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (syncs in flight at the save are merged at their step),
        or a plain local-SGD or optimizer state dict (no syncs in flight).

        Raises:
            ValueError: as :meth:`LocalSGDMode.load_state_dict`, or a sync in flight that does not fit
                this wrapper's parameters.
        """
        mine = state_dict.get(STATE_KEY) or {}
        pending = (mine.get(STREAMING_KEY) or {}).get("pending", [])
        params = ctx.params
        for sync in pending:
            for i, value in zip(sync["params"], sync["values"]):
                shape = None if value is None else tuple(value.shape)  # None: no rank sent one (frozen)
                if not 0 <= i < len(params) or (shape is not None and shape != tuple(params[i].shape)):
                    raise ValueError(
                        f"state_dict[{STATE_KEY!r}][{STREAMING_KEY!r}] holds a sync in flight for parameter {i} of shape "
                        f"{shape}, which does not fit this optimizer's parameters; load a state dict "
                        "saved by the same model and optimizer"
                    )
        if pending and self._vote is not None:
            # Under fault tolerance a sync is applied only after its commit vote, in the quorum that
            # launched it; a saved one has neither any more. Its fragment's progress goes with the
            # fragment's next sync, which the quorum's count names (the vote never counted this one).
            warnings.warn(
                f"state_dict holds {len(pending)} streaming sync(s) in flight, which fault_tolerance cannot apply "
                "after a load (each needs the commit vote of the quorum that sent it); they are dropped, and their "
                "fragments' progress goes with their next syncs. Save between syncs to keep them", stacklevel=3)
            pending = []
        super().load_state_dict(ctx, state_dict)
        if STATE_KEY in state_dict:
            self._take_pending(ctx, [(int(sync["fragment"]), int(sync["launched"]),
                                      [(params[i], None if value is None else
                                        value.to(params[i].device, params[i].dtype).clone())
                                       for i, value in zip(sync["params"], sync["values"])]) for sync in pending])

    def _take_pending(self, ctx: ModeContext,
                      pending: List[Tuple[int, int, List[Tuple[Tensor, Optional[Tensor]]]]]) -> None:
        """Replace the syncs in flight with ``pending`` (each arrived already): ours are waited for and dropped."""
        for sync in self._pending.values():
            if sync.exchange is not None:
                ctx.engine.arrive_partial(sync.exchange)
        self._pending = {fragment: _Sync(launched, None, values) for fragment, launched, values in pending}
        self._plan = ctx.engine.packs

    def broadcast_state(self, ctx: ModeContext, src: int) -> None:
        """Rank ``src``'s local-SGD state, and its syncs in flight (their means travel, already arrived)."""
        super().broadcast_state(ctx, src)
        if ctx.world_size == 1:
            return
        group, params = ctx.group, ctx.params
        is_src = dist.get_rank(group) == src
        index = {id(p): i for i, p in enumerate(params)}
        if is_src:
            for sync in self._pending.values():
                if sync.exchange is not None:
                    ctx.engine.arrive_partial(sync.exchange)
        values = {f: self._arrived(sync) for f, sync in self._pending.items()} if is_src else {}
        # Each sync's fragment, step, members and which of them no rank sent (no mean to travel).
        meta = [[(f, sync.launched, [index[id(p)] for p, _ in values[f]],
                  [k for k, (_, mean) in enumerate(values[f]) if mean is None]) for f, sync in self._pending.items()]
                if is_src else None]
        with stalls.inspected(ctx.progress, "the broadcast of the streaming syncs in flight"):
            collectives.broadcast_object_list(meta, src=src, group=group)
        theirs = meta[0]
        pending = [(f, launched, [(params[i], None if k in unsent else
                                   values[f][k][1] if is_src else torch.zeros_like(params[i]))
                                  for k, i in enumerate(members)]) for f, launched, members, unsent in theirs]
        tensors = [mean for _, _, items in pending for _, mean in items if mean is not None]
        if tensors:
            with torch.no_grad(), stalls.inspected(ctx.progress, "the broadcast of the streaming syncs in flight"):
                collectives.broadcast_parameters(tensors, src=src, group=group)
        self._take_pending(ctx, pending)

    # ------------------------------------------------------------------ the drift check

    def kept_identical(self, ctx: ModeContext, scheduled: bool) -> Optional[drift.Kept]:
        """The last-sync copies, the outer optimizer and the step count, at any step: the parameters
        are never all synced at once (a fragment at a time, and mixed with local progress)."""
        if not ctx.engine.exchange.local:
            return super().kept_identical(ctx, scheduled)
        outer = self.outer
        anchors = [self._anchors.get(id(p)) for p in ctx.params]
        outer_state = (drift.state_items(outer, anchors, "outer optimizer state") if outer is not None
                       else [[] for _ in ctx.params])
        shared = [] if outer is None else drift.hyperparameter_items(outer, "outer optimizer param_groups")
        shared += [("the step count", ctx.steps)]
        return drift.Kept(
            per_param=[([] if a is None else [("last-sync copy", a)]) + state for a, state in zip(anchors, outer_state)],
            shared=shared,
            what="the parameters' last-sync copies" + ("" if outer is None else ", the outer optimizer's state and "
                 "hyperparameters") + " and the step count (streaming local SGD syncs a fragment at a time: each "
                 "rank's parameters are its own)",
        )
