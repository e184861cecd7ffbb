"""Local SGD and DiLoCo: every rank trains alone, and the ranks meet every ``sync_every`` steps.

This is the implementation of whole-model syncs; the user builds it as :class:`distopt.LocalSGD` or
:class:`distopt.DiLoCo` (:mod:`distopt.modes.diloco`), or with the ``sync_every=`` shorthands.

Between two syncs no gradient is reduced: backward leaves ``.grad`` as this
rank's own gradient and the inner optimizer steps on it. Every ``sync_every``-th
step (after ``local_warmup`` synchronous steps) the ranks average their progress
since the last sync, the *pseudo-gradient* ``anchor - param`` (the parameters at
the last sync minus the parameters now, so it points the way a gradient does):

- **plain averaging** (no outer optimizer, torch's ``PostLocalSGDOptimizer``):
  ``param = anchor - mean(anchor - param_r)``, the mean of the ranks' parameters;
- **DiLoCo** (Douillard et al. 2023): the mean pseudo-gradient is the gradient
  of the anchors for the *outer optimizer* (e.g. Nesterov SGD, lr 0.7,
  momentum 0.9); every rank steps it alike and takes its result.

A parameter frozen mid-training (``requires_grad_(False)``, no gradient set by
hand) that has not moved since the last sync has nothing to send: it travels with
a presence flag of 0, and where no rank sent it, its pseudo-gradient is None on
every rank, so the outer optimizer skips it (as a ``torch.optim`` optimizer skips
a parameter without a gradient) and its momentum does not move it on; frozen on
some ranks only, it is averaged with their zeros, as a gradient is in synchronous
training. So a parameter frozen mid-training moves once more, at the sync that
takes its progress since the last one (with streaming's mixing, to the global
value), then never while it stays frozen.

The pseudo-gradients travel through the engine's packs, in its fixed plan, one
all-reduce per pack (:meth:`distopt.engine.GradientEngine.launch_exchange`).
Sending the change rather than the parameters means that ``compression``
rounds only the change: the anchors stay exact, and every rank applies the same
rounded mean to the same anchor, so the ranks are bitwise identical after
every sync. The extra memory is one copy of the trainable parameters (the
anchors) plus the outer optimizer's state (a momentum buffer each for SGD);
:attr:`distopt.StepStats.extra_state_bytes` reports it.

Join: a rank that runs out of data with local steps since the last sync sends
them in one last exchange, as a contributor whose flags say that it contributes
for the last time, then shadows the others' exchanges with zeros and a
contributing flag of 0; each exchange averages over the ranks that contributed
to it. Between two syncs no round carries flags, so the ranks still training
learn that a rank has joined only from their next sync's: a collective of their
own (the drift check) runs only right after a sync whose flags say that every
rank trains on (:meth:`LocalSGDMode.ranks_training`).

**Checkpoints, and taking one rank's state** (the end of a join block,
``broadcast_optimizer_state()``). Besides the inner optimizer, a local-SGD wrapper holds the step count, the
steps since the last sync, the *anchors* (the parameters at the last sync) and,
for DiLoCo, the outer optimizer over the anchors. The outer optimizer's param
groups come about by history: one at construction, one more for each
``add_param_group`` or parameter unfrozen since. So its layout is saved as
lists of parameter indices (positions in the wrapper's parameter list, the
inner state dict's order), and a load or a broadcast rebuilds the outer
optimizer's groups to that layout before its state goes in: a checkpoint loads
into a wrapper built with the param groups at construction as well as into one
that replays the ``add_param_group`` calls. The outer optimizer is the mode's
own (built by the factory over the anchors), so nobody else holds its groups.

``GradScaler``, which must not skip a step on one rank only, is handled in
:mod:`distopt.modes.amp`.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from .. import collectives
from ..engine import GradientEngine
from ..engine.packs import Pack, send_in_place
from ..planning import drift
from ..planning.mixing import mix_
from ..transport import stalls
from . import amp, shards
from .base import Mode, ModeContext, OuterFactory, SyncVote
from .synchronous import Synchronous

__all__ = ["LocalSGDMode", "STATE_KEY", "LAYOUT_KEY", "last_contribution"]

#: The key under which ``state_dict()`` holds the mode's state, next to the inner optimizer's
#: ``state`` and ``param_groups``: a plain ``torch.optim`` optimizer ignores it when loading.
STATE_KEY = "distopt_local_sgd"

#: Within it: the outer optimizer's param groups, as lists of parameter indices.
LAYOUT_KEY = "outer_groups"

#: The outer optimizer's param groups, as lists of parameter indices.
Layout = List[List[int]]


class LocalSGDMode(Mode):
    """Train locally, average (or take an outer step on) the pseudo-gradient every ``sync_every`` steps.

    Args:
        sync_every: local steps between two syncs (H).
        outer_optimizer: builds the outer optimizer (DiLoCo) from the anchors; None
            averages the parameters.
        local_warmup: synchronous steps before the first local one (W).
    """

    handles_amp_scaling = True

    def __init__(self, sync_every: int, outer_optimizer: Optional[OuterFactory], local_warmup: int) -> None:
        self.sync_every = sync_every
        self.local_warmup = local_warmup
        self.reduces_in_backward = local_warmup > 0  # per instance: true during the warm-up only
        self.outer: Optional[Optimizer] = None  # built by the factory from the anchors
        self.since_sync = 0  # local steps since the last sync
        self._factory = outer_optimizer
        self._synchronous = Synchronous()
        self._anchors: Dict[int, Tensor] = {}  # id(parameter) -> its value at the last sync
        self._seen = 0  # the wrapper's parameters looked at for anchors
        self._untracked: List[Tensor] = []  # parameters without an anchor, frozen when looked at
        # Fault tolerance (distopt.fault_tolerance): the commit vote of each sync, or None.
        self._vote: Optional[SyncVote] = None
        self._joined = False  # fault tolerance: this process has committed a sync, or healed in one
        self._synced_now = False  # the last step read a round's flags (it synced, or was a warm-up step)
        # ids of the parameters this rank sent no pseudo-gradient for in the exchange that last carried them
        self._unsent: Set[int] = set()
        # ids of the parameters whose own storage carries the exchange in flight (their pseudo-gradient, then
        # the mean): a whole-model sync gives them their anchors' values afterwards (:meth:`_filler`)
        self._in_place: Set[int] = set()

    def fault_tolerant(self, vote: SyncVote) -> bool:
        """Sync under a torchft Manager: every sync is a quorum (the exchange opens it), ``vote.commit()``
        (``should_commit``) is voted between the exchange and applying its result, and a process's
        first step ends with a sync (where a fresh job's replicas take the primary's state and a
        replacement heals from a live peer: parameters, anchors, outer optimizer, steps since the
        sync). A sync voted down moves nothing: the anchors and the outer optimizer stay, and the
        parameters go back to the anchors, alike on every replica that discarded it."""
        self._vote = vote
        return True

    # ------------------------------------------------------------------ the seam

    def settings(self) -> Dict[str, Any]:
        # A factory cannot be compared across processes; whether there is one can.
        return {"sync_every": self.sync_every, "local_warmup": self.local_warmup,
                "outer_optimizer": self._factory is not None}

    def check_compatible(self, *, optimizer: Optimizer, reduce_op: str, bcast_period: int,
                         fault_tolerant: bool) -> None:
        if reduce_op != "mean":
            raise ValueError(
                f"reduce_op={reduce_op!r} cannot be combined with {self.describe()}: local SGD averages the ranks' "
                "parameters; use reduce_op='mean'"
            )
        if bcast_period > 0:
            raise ValueError(
                f"bcast_period={bcast_period!r} cannot be combined with {self.describe()}: every sync leaves the "
                "ranks identical already; use bcast_period=0"
            )
        if fault_tolerant and self.local_warmup:
            raise ValueError(
                f"{self.named('warmup')} > 0 cannot be combined with fault_tolerance: a replacement that joins "
                "while the others train locally would send a warm-up step's gradients into their sync. Use "
                f"{self.named('warmup')}=0 (a replica's first step ends with a sync, which gives every replica the "
                "same starting point)"
            )

    def attach(self, ctx: ModeContext) -> None:
        ctx.engine.forbid_rows()
        self._track(ctx)
        self._set_local(ctx, ctx.steps >= self.local_warmup)

    def step(self, ctx: ModeContext, closure: Optional[Callable[[], Any]]) -> Any:
        step = ctx.steps
        warm = step < self.local_warmup
        self._synced_now = warm
        if warm and amp.handed_over(ctx):
            ctx.reduce_for_step()  # unscale the averaged gradients, not local ones the reduction would replace
        # GradScaler hands every step over (``_step_supports_amp_scaling``): one rank's inf skips its
        # inner step only, and the step still counts, so the ranks' syncs stay paired.
        skip = amp.unscale_or_skip(ctx)
        if warm:
            loss = None if skip else self._synchronous.step(ctx, closure)
            if step + 1 == self.local_warmup:  # the next backward already stays local
                self._track(ctx)
                with torch.no_grad():
                    for p, anchor in self._pairs(ctx):
                        anchor.copy_(p)  # identical on every rank after synchronous steps
                self._set_local(ctx, True)
            return loss
        ctx.engine.reset_stats()  # nothing on the wire, unless this step syncs
        self._track(ctx)
        if skip:
            loss = None
        else:
            loss = ctx.step_inner(closure)
        ctx.inner_step_taken()
        self._after_local_step(ctx)
        return loss

    def follow_step(self, ctx: ModeContext) -> None:
        """Count a local step that ranks this one replicates took without it, and sync when it is due.

        ``distopt.Islands`` calls it on a rank that ran out of data inside ``join()`` while the other ranks of
        its island train on: the inner optimizer is not stepped; :meth:`ModeContext.inner_step_taken` gives this
        rank its island's parameters, so that it takes part in the syncs across as its island's copy.
        """
        ctx.engine.reset_stats()
        self._track(ctx)
        ctx.inner_step_taken()
        self._after_local_step(ctx)

    def _after_local_step(self, ctx: ModeContext) -> None:
        """After a local step (the inner step taken or skipped): sync when the period is over."""
        self.since_sync += 1
        if self.since_sync >= self.sync_every or (self._vote is not None and not self._joined):
            self._sync(ctx)

    def sync_now(self, ctx: ModeContext) -> None:
        """Sync at once, as at the end of a period (every rank calls it at the same point): the ranks then
        hold the same parameters, e.g. for a checkpoint saved on one rank. The period starts again from
        here: the next sync comes ``every`` local steps later. Nothing to do during the warm-up (it is
        synchronous) or right after a sync.

        Raises:
            RuntimeError: under fault tolerance, where every sync is a quorum of the replicas on the
                schedule they share.
        """
        if self._vote is not None:
            raise RuntimeError(
                "sync_now() is not available with fault_tolerance: every sync is a quorum of the replicas on the "
                "schedule they share, and a replica that joins later would not make the extra one. Save the "
                "checkpoint right after a scheduled sync instead (every sync_every steps)")
        ctx.engine.reset_stats()  # stats then say what this call sent
        if not ctx.engine.exchange.local or self.since_sync == 0:
            return
        self._sync(ctx)
        self._synced_now = True

    def leaving(self, ctx: ModeContext) -> Optional[Callable[[], None]]:
        # Steps not averaged yet are sent once, as a contributor for the last time; a rank without any
        # just shadows.
        if ctx.world_size == 1 or not ctx.engine.exchange.local or self.since_sync == 0:
            return None
        self.since_sync = 0
        self._launch(ctx, leaving=True)
        return lambda: self._finish(ctx)

    def ranks_training(self, ctx: ModeContext) -> Optional[int]:
        """Right after a sync (or a warm-up step), what its flags say; between two syncs None: no round
        carries flags there, and the others learn that a rank ran out of data only from their next sync,
        whose flags say that it contributes for the last time (:meth:`leaving`) or not at all."""
        if ctx.engine.exchange.local and not self._synced_now:
            return None
        return super().ranks_training(ctx)

    def extra_state_bytes(self, ctx: ModeContext) -> int:
        # Counted when asked (opt.stats), not at every sync: it walks every anchor and outer state.
        tensors = list(self._anchors.values())
        if self.outer is not None:
            tensors += [v for state in self.outer.state.values() for v in state.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kept_identical(self, ctx: ModeContext, scheduled: bool) -> Optional[drift.Kept]:
        """Right after a sync: the parameters and the outer optimizer; between syncs, where each rank's
        parameters differ on purpose, a periodic check waits for the next sync, and ``check_drift()``
        compares the last-sync copies. The inner optimizer's state is each rank's own, never compared
        (but during ``local_warmup``, which is synchronous training)."""
        if not ctx.engine.exchange.local:
            return super().kept_identical(ctx, scheduled)
        if self.since_sync and scheduled:
            return None
        outer = self.outer
        anchors = [self._anchors.get(id(p)) for p in ctx.params]
        outer_state = (drift.state_items(outer, anchors, "outer optimizer state") if outer is not None
                       else [[] for _ in ctx.params])
        shared = [] if outer is None else drift.hyperparameter_items(outer, "outer optimizer param_groups")
        shared += [("the step count", ctx.steps), ("the steps since the last sync", self.since_sync)]
        outer_words = "" if outer is None else ", the outer optimizer's state and hyperparameters"
        if not self.since_sync:
            return drift.Kept(
                per_param=[[(drift.PARAMETER, p)] + state for p, state in zip(ctx.params, outer_state)],
                shared=shared,
                what=f"the parameters right after a sync{outer_words} and the step count (not the inner "
                     "optimizer's state: in local SGD each rank's is its own)",
            )
        return drift.Kept(
            per_param=[([] if a is None else [("last-sync copy", a)]) + state for a, state in zip(anchors, outer_state)],
            shared=shared,
            what=f"the parameters' last-sync copies{outer_words} and the step count (between two syncs each "
                 "rank's parameters differ on purpose)",
        )

    # ------------------------------------------------------------------ the sync

    def _sync(self, ctx: ModeContext) -> None:
        self.since_sync = 0
        if not self._needs_anchors(ctx):  # plain averaging over one rank changes nothing
            return
        if ctx.world_size > 1 or self._vote is not None:
            self._launch(ctx)
            self._finish(ctx)
            self._synced_now = True
            return
        with torch.no_grad():  # DiLoCo in one process: the pseudo-gradient is this rank's own
            self._apply([(p, anchor, self._pseudo_gradient_alone(p)) for p, anchor in self._pairs(ctx)])

    def _launch(self, ctx: ModeContext, leaving: bool = False) -> None:
        """Send the pseudo-gradients (``leaving``: as this rank's last contribution, see :func:`last_contribution`).
        A whole-model sync: each parameter takes the sync's values once it is back (:meth:`_finish`), so a
        parameter alone in its pack carries its pseudo-gradient in its own storage (:meth:`_filler`); not
        under fault tolerance, where a replica may heal (take a peer's parameters) before the mean is applied."""
        engine = ctx.engine
        if engine.progress is not None:
            engine.progress.phase = "inside step() (local SGD: averaging the pseudo-gradients)"
        try:
            with torch.no_grad(), last_contribution(engine, leaving):
                engine.launch_exchange(self._filler(ctx, in_place=self._vote is None))
        except BaseException:
            self._restore_in_place(ctx)
            raise

    def _restore_in_place(self, ctx: ModeContext) -> None:
        """A sync that failed midway: the parameters that carried it take their anchors' values (the last
        sync's), not a pseudo-gradient."""
        with torch.no_grad():
            for p, anchor in self._pairs(ctx):
                if id(p) in self._in_place:
                    p.copy_(anchor)
        self._in_place.clear()

    def _filler(self, ctx: ModeContext, in_place: bool = False) -> Callable[[Pack], None]:
        """What an exchange writes into each pack: the pseudo-gradients ``anchor - param``, scaled, and
        which members have none (:func:`_nothing_to_send`: their presence flag is 0).

        Args:
            in_place: the parameters take the sync's values when it is back (a whole-model sync without
                mixing): a pack of one parameter that needs no buffer of its own (a large gradient's,
                :attr:`Pack.direct`) then sends from the parameter's own storage, which the pseudo-gradient
                and then the mean overwrite, rather than from a second copy. The same values travel.
        """
        self._in_place.clear()

        def fill(pack: Pack) -> None:
            scale = ctx.engine.scale  # read as each pack launches: under fault tolerance it is set as the round opens
            pack.absent.clear()
            if in_place and pack.direct and pack.params[0].is_contiguous():
                send_in_place(pack, pack.params[0].detach())
                self._in_place.add(id(pack.params[0]))
            for j, (p, view) in enumerate(zip(pack.params, pack.views)):
                if p.grad is view:  # left by a synchronous round: .grad stays this rank's own gradient
                    p.grad = view.clone()
                torch.sub(self._anchor_of(p), p.detach(), out=view)
                self._unsent.discard(id(p))
                if _nothing_to_send(p, view):
                    pack.absent.append(j)
                    self._unsent.add(id(p))
                if scale is not None:  # before a 16-bit cast, as for gradients
                    view.mul_(scale)

        return fill

    def _pseudo_gradient_alone(self, p: Tensor) -> Optional[Tensor]:
        """DiLoCo in one process: ``anchor - p``, this rank's own mean, or None where there is nothing to
        send (:func:`_nothing_to_send`)."""
        pseudo = self._anchor_of(p) - p
        return None if _nothing_to_send(p, pseudo) else pseudo

    def _received(self, pack: Pack, views: List[Tensor]) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """Each member of ``pack``, back from an exchange, with its mean pseudo-gradient (its view), or None
        where no rank sent one. Only a member this rank did not send can be one, so only then are the
        presence flags read (the same sums on every rank)."""
        present: Optional[List[float]] = None
        out: List[Tuple[Tensor, Optional[Tensor]]] = []
        for j, (p, view) in enumerate(zip(pack.params, views)):
            if id(p) in self._unsent:
                if present is None:
                    present = pack.flags[: len(pack.params)].tolist()
                if not present[j]:
                    out.append((p, None))
                    continue
            out.append((p, view))
        return out

    def _finish(self, ctx: ModeContext) -> None:
        try:
            self._finish_exchange(ctx)
        except BaseException:
            self._restore_in_place(ctx)
            raise
        self._in_place.clear()

    def _finish_exchange(self, ctx: ModeContext) -> None:
        engine = ctx.engine
        with torch.no_grad():
            engine.finish_exchange()
            committed = self._vote is None or self._vote.commit()  # may heal: the items are taken after it
            # Healed, even in a sync voted down, this replica holds its peers' state and schedule.
            self._joined = self._joined or (self._vote is not None and (committed or self._vote.healed_now))
            if not committed:
                for p, anchor in self._pairs(ctx):
                    p.copy_(anchor)
                return
            self._apply([(p, self._anchor_of(p), mean)
                         for pack in engine.packs for p, mean in self._received(pack, pack.views)])

    def _apply(self, items: List[Tuple[Tensor, Tensor, Optional[Tensor]]], alpha: float = 0.0) -> None:
        """Move the anchors by the mean pseudo-gradient and give the parameters their values.

        Args:
            items: ``(parameter, anchor, mean pseudo-gradient)``; the outer optimizer steps only
                these anchors (the others have no gradient), so it can step one fragment at a time.
                A pseudo-gradient of None (no rank sent one: frozen and unmoved everywhere) leaves
                its parameter and anchor as they are, the outer optimizer's state included.
            alpha: the parameters become ``alpha * param + (1 - alpha) * anchor`` (streaming's
                mixing, :func:`distopt.planning.mixing.mix_`); 0 copies the anchors. A frozen parameter
                takes its anchor: it makes no local progress to keep, and is then not sent again.
        """
        if self.outer is None:
            for _, anchor, pseudo in items:
                if pseudo is not None:
                    anchor.sub_(pseudo)
        else:
            for _, anchor, pseudo in items:
                anchor.grad = pseudo  # None: skipped, as torch optimizers skip a parameter without a gradient
            self.outer.step()
            for _, anchor, _ in items:
                anchor.grad = None  # the pack views are reused by the next exchange
        for p, anchor, pseudo in items:
            if pseudo is not None:
                mix_(p, anchor, alpha if p.requires_grad or p.grad is not None else 0.0)
            elif id(p) in self._in_place:  # it sent nothing (unmoved): its storage carried zeros
                p.copy_(anchor)

    # ------------------------------------------------------------------ checkpoints and taking one rank's state

    def state_dict(self, ctx: ModeContext) -> Dict[str, Any]:
        """The inner optimizer's state dict, plus the mode's state under :data:`STATE_KEY`."""
        out = dict(ctx.optimizer.state_dict())
        out[STATE_KEY] = {
            "steps": ctx.steps,
            "since_sync": self.since_sync,
            "anchors": [self._anchors.get(id(p)) for p in ctx.params],
            "outer": None if self.outer is None else self.outer.state_dict(),
            LAYOUT_KEY: self.outer_layout(ctx),
        }
        return out


    def load_state_dict(self, ctx: ModeContext, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, or a plain optimizer's state dict (the mode then keeps its state).

        Everything is checked before anything changes, and the inner optimizer (which
        checks its own part) is loaded before the mode's state: a load that raises
        leaves the wrapper as it was.

        Raises:
            ValueError: the state dict was saved by another model or optimizer, with an
                outer optimizer into a wrapper without one, or (saved by an older distopt,
                without the layout) with an outer optimizer whose param groups this wrapper
                cannot rebuild.
        """
        state_dict = shards.whole(state_dict)
        mine = state_dict.get(STATE_KEY)
        if mine is None:  # a plain optimizer's state dict: the mode keeps its own state
            ctx.optimizer.load_state_dict(state_dict)
            return
        params = ctx.params
        saved = mine["anchors"]
        if len(saved) != len(params):
            raise ValueError(
                f"state_dict[{STATE_KEY!r}] holds last-sync copies of {len(saved)} parameters but this "
                f"optimizer has {len(params)}; load a state dict saved by the same model and optimizer"
            )
        for i, (p, anchor) in enumerate(zip(params, saved)):
            if anchor is not None and tuple(anchor.shape) != tuple(p.shape):
                raise ValueError(
                    f"state_dict[{STATE_KEY!r}] holds a last-sync copy of shape {tuple(anchor.shape)} for parameter {i}, "
                    f"which has shape {tuple(p.shape)} here; load a state dict saved by the same model and optimizer"
                )
        if mine["outer"] is not None and self._factory is None:
            raise ValueError(
                "the state dict was saved with an outer_optimizer (DiLoCo) but this DistributedOptimizer has none; "
                "pass the same outer_optimizer= as when it was saved"
            )
        steps, since_sync = int(mine["steps"]), int(mine["since_sync"])
        anchored = self._needs_anchors(ctx)
        layout = self._checked_layout(ctx, mine) if anchored and mine["outer"] is not None else None
        ctx.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != STATE_KEY})
        # Nothing below can fail on the state dict's account.
        ctx.set_steps(steps)
        self.since_sync = since_sync
        if anchored:
            missing = [p for p, anchor in zip(params, saved) if anchor is not None and id(p) not in self._anchors]
            self._new_anchors(missing, grouped=layout is None)
            with torch.no_grad():
                for p, anchor in zip(params, saved):
                    if anchor is not None:
                        self._anchors[id(p)].copy_(anchor)
            if layout is not None:
                rest = self._rebuild_outer(ctx, layout)
                self.outer.load_state_dict(mine["outer"])
                if rest:  # parameters without a last-sync copy in the checkpoint: the factory's defaults
                    self.outer.add_param_group({"params": rest})
        self._set_local(ctx, ctx.steps >= self.local_warmup)


    def broadcast_state(self, ctx: ModeContext, src: int) -> None:
        """Give every rank rank ``src``'s step count, steps since the last sync, anchors and outer optimizer.

        Every rank must call it (at the end of a join block, or in ``broadcast_optimizer_state()``).
        Which parameters have anchors, and the outer optimizer's layout, travel first, so
        ranks whose histories differ (only the root loaded a checkpoint) end up alike.
        """
        if ctx.world_size == 1:
            return
        group, progress = ctx.group, ctx.progress
        params = ctx.params
        is_src = dist.get_rank(group) == src
        meta = [{"steps": ctx.steps, "since_sync": self.since_sync,
                 "anchored": [i for i, p in enumerate(params) if id(p) in self._anchors],
                 "layout": self.outer_layout(ctx)} if is_src else None]
        with stalls.inspected(progress, "the broadcast of the local-SGD step count and last-sync layout"):
            collectives.broadcast_object_list(meta, src=src, group=group)
        theirs = meta[0]
        if not is_src:
            self._keep_anchors_of(ctx, theirs["anchored"])
            if theirs["layout"] is None:
                self.outer = None  # src has none yet; the factory builds it with the first anchor, as on src
            else:
                rest = self._rebuild_outer(ctx, theirs["layout"])
                if rest:
                    self.outer.add_param_group({"params": rest})
        anchors = [self._anchors[id(params[i])] for i in theirs["anchored"]]
        if anchors:
            with torch.no_grad(), stalls.inspected(progress, "the broadcast of the last-sync parameters"):
                collectives.broadcast_parameters(anchors, src=src, group=group)
        if theirs["layout"] is not None:
            with stalls.inspected(progress, "the outer-optimizer state broadcast"):
                collectives.broadcast_optimizer_state(self.outer, src=src, group=group)
        ctx.set_steps(int(theirs["steps"]))
        self.since_sync = int(theirs["since_sync"])
        self._set_local(ctx, ctx.steps >= self.local_warmup)


    # ------------------------------------------------------------------ the outer optimizer's layout

    def outer_layout(self, ctx: ModeContext) -> Optional[Layout]:
        """The outer optimizer's param groups as lists of parameter indices; None without an outer optimizer."""
        if self.outer is None:
            return None
        index = {id(self._anchors[id(p)]): i for i, p in enumerate(ctx.params) if id(p) in self._anchors}
        return [[index[id(anchor)] for anchor in group["params"]] for group in self.outer.param_groups]


    def _checked_layout(self, ctx: ModeContext, mine: Dict[str, Any]) -> Layout:
        """The layout to rebuild the outer optimizer to before loading ``mine["outer"]``.

        Raises:
            ValueError: it does not fit the saved outer optimizer; or the checkpoint has no layout
                (an older distopt's) and this wrapper's outer groups would not come out as saved.
        """
        sizes = [len(group["params"]) for group in mine["outer"]["param_groups"]]
        layout = mine.get(LAYOUT_KEY)
        if layout is None:
            # Saved before the layout was: the groups come out as the old load made them (the outer's
            # groups now, plus one per parameter given an anchor by the load), and must match the saved ones.
            layout = self.outer_layout(ctx) or []
            layout += [[i] for i, (p, anchor) in enumerate(zip(ctx.params, mine["anchors"]))
                       if anchor is not None and id(p) not in self._anchors]
            if [len(group) for group in layout] != sizes:
                raise ValueError(
                    f"state_dict[{STATE_KEY!r}] was saved by an older distopt, without the outer optimizer's layout: "
                    f"its outer optimizer has {len(sizes)} param groups of {sizes} tensors, and this wrapper's would "
                    f"have {len(layout)} of {[len(group) for group in layout]}; build the wrapper as the run that saved "
                    "it was built (the same param groups at construction, then the same add_param_group calls and "
                    "unfrozen parameters, in order) before loading it"
                )
            return layout
        flat = [i for group in layout for i in group]
        if ([len(group) for group in layout] != sizes or len(set(flat)) != len(flat)
                or any(not isinstance(i, int) or not 0 <= i < len(ctx.params) or mine["anchors"][i] is None
                       for i in flat)):
            raise ValueError(
                f"state_dict[{STATE_KEY!r}][{LAYOUT_KEY!r}] = {layout!r} does not fit its outer optimizer's "
                f"{len(sizes)} param groups of {sizes} tensors over the parameters with a last-sync copy; load a "
                "state dict saved by DistributedOptimizer.state_dict() for the same model"
            )
        return [list(group) for group in layout]


    def _rebuild_outer(self, ctx: ModeContext, layout: Layout) -> List[Tensor]:
        """Give the outer optimizer exactly ``layout``'s param groups, without state; return the anchors left out.

        Every parameter in ``layout`` has an anchor already. The groups get the optimizer's defaults, which
        the ``load_state_dict`` that follows replaces with the saved hyperparameters.
        """
        params = ctx.params
        groups = [[self._anchors[id(params[i])] for i in group] for group in layout]
        placed = {i for group in layout for i in group}
        rest = [self._anchors[id(p)] for i, p in enumerate(params) if id(p) in self._anchors and i not in placed]
        if self.outer is None:
            if not groups and not rest:
                return rest
            self._give_outer([a for group in groups for a in group] + rest)
        outer = self.outer
        outer.param_groups = []
        outer.state = defaultdict(dict)
        for group in groups:
            outer.add_param_group({"params": group})
        return rest


    def _keep_anchors_of(self, ctx: ModeContext, anchored: List[int]) -> None:
        """Hold anchors for exactly the parameters at ``anchored`` (values follow; the outer groups are rebuilt)."""
        params = ctx.params
        wanted = {id(params[i]) for i in anchored}
        for key in [key for key in self._anchors if key not in wanted]:
            del self._anchors[key]
        self._new_anchors([params[i] for i in anchored if id(params[i]) not in self._anchors], grouped=False)
        # Parameters left without an anchor get one when trainable, at the next step, as on every rank.
        self._untracked = [p for p in params if id(p) not in self._anchors]
        self._seen = len(params)

    # ------------------------------------------------------------------ anchors

    def _needs_anchors(self, ctx: ModeContext) -> bool:
        return ctx.world_size > 1 or self._factory is not None or self._vote is not None

    def _set_local(self, ctx: ModeContext, local: bool) -> None:
        self.reduces_in_backward = not local
        ctx.engine.keep_gradients_local(local)

    def _pairs(self, ctx: ModeContext) -> List[Tuple[Tensor, Tensor]]:
        return [(p, self._anchors[id(p)]) for p in ctx.params if id(p) in self._anchors]

    def _track(self, ctx: ModeContext) -> None:
        """Give an anchor to every trainable parameter without one (new groups, unfrozen parameters)."""
        params = ctx.params
        if not self._needs_anchors(ctx) or (
            len(params) == self._seen and not any(p.requires_grad for p in self._untracked)
        ):
            return
        self._new_anchors([p for p in params if p.requires_grad and id(p) not in self._anchors])
        self._untracked = [p for p in params if id(p) not in self._anchors]
        self._seen = len(params)

    def _anchor_of(self, p: Tensor) -> Tensor:
        anchor = self._anchors.get(id(p))
        return anchor if anchor is not None else self._new_anchors([p])[0]

    def _new_anchors(self, params: List[Tensor], grouped: bool = True) -> List[Tensor]:
        """Copy ``params`` as they are now (the same on every rank: a sync or the broadcast left them so).

        Args:
            params: parameters without an anchor.
            grouped: give the anchors to the outer optimizer (False: the caller places them).
        """
        anchors = [p.detach().clone() for p in params]
        self._anchors.update((id(p), a) for p, a in zip(params, anchors))
        if anchors and grouped and self._factory is not None:
            self._give_outer(anchors)
        return anchors

    def _give_outer(self, anchors: List[Tensor]) -> None:
        """Build the outer optimizer over ``anchors``, or add them as a new param group (the factory's defaults)."""
        if self.outer is None:
            self.outer = _build_outer(self._factory, anchors)
        else:  # a new param group, or a parameter unfrozen since
            self.outer.add_param_group({"params": anchors})


def _nothing_to_send(p: Tensor, pseudo: Tensor) -> bool:
    """Whether ``p`` has no pseudo-gradient: frozen (no ``requires_grad``, no gradient set by hand, which the
    inner optimizer would step) and not moved since the last sync (``pseudo``, ``anchor - p``, all zero).
    A trainable parameter is always sent, so only frozen ones pay for the look at their values."""
    return not p.requires_grad and p.grad is None and not bool(pseudo.any())


@contextmanager
def last_contribution(engine: GradientEngine, leaving: bool = True) -> Iterator[None]:
    """Around the launch of this rank's last contributions (``leaving``): their control flags say so, and
    the ranks still training learn from them that it has joined, as they learn it from a shadow round's."""
    with engine.announce(leaving=leaving):
        yield


def _build_outer(factory: OuterFactory, anchors: List[Tensor]) -> Optimizer:
    """Call the user's factory and check that it built an optimizer over the tensors it was given.

    Raises:
        TypeError: it returned no ``torch.optim.Optimizer``.
        ValueError: the optimizer holds other tensors (e.g. ``model.parameters()``).
    """
    outer = factory(anchors)
    if not isinstance(outer, Optimizer):
        raise TypeError(
            f"outer_optimizer must return a torch.optim.Optimizer, got {type(outer).__name__}; e.g. "
            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
        )
    held = {id(p) for group in outer.param_groups for p in group["params"]}
    if held != {id(a) for a in anchors}:
        raise ValueError(
            "outer_optimizer must build its optimizer over the tensors it is given (distopt's copies of the "
            "parameters at the last sync), not over the model's parameters; write "
            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
        )
    return outer
