"""The reduction engine under :class:`distopt.DistributedOptimizer`: hooks, packs and the round.

This is the hot path, and all of it is here. A post-accumulate-grad hook on every
tracked parameter marks its gradient ready; the gradient moves into its pack's
persistent flat buffer (scaled in the same pass) and ``.grad`` becomes a view of
its slice. Packs launch one asynchronous collective each, strictly in the order of
a plan every rank holds identically (:class:`distopt.planning.packing.LaunchOrder`).
At the end of the reducing backward pass (an autograd engine callback) the rest is
flushed, and everything is awaited in :meth:`GradientEngine.finish_round`, the one
place that waits.

**A round's life** (:class:`RoundState`)::

    OPEN ──first hook of the reducing pass──▶ IN_FLIGHT ──flush()──▶ FLUSHED ──finish_round()──▶ SETTLED
      ▲            (packs launch as they fill)          (every pack sent)   (every pack back:      │
      └───────────────────────── step() / zero_grad(): reset_round() ◀───── gradients final) ◀───┘

Backward passes before the reducing one (``backward_passes_per_step``, ``no_sync()``,
local SGD) accumulate locally while the round is ``OPEN``. The wait at the end of
backward is bounded (:data:`BACKWARD_PATIENCE`): a rank whose backward reached no
parameter sends its packs only in ``step()``, and an unbounded wait would deadlock
with any collective that rank runs first; the round then stays ``FLUSHED`` (pending)
until ``synchronize()``, ``step()`` or ``zero_grad()`` finishes it.

Once a round is back, the control flags in every pack (:mod:`distopt.planning.control`)
tell every rank alike whether the ranks reduced at different points (an error on
every rank), unfroze parameters (tracked at once, on every rank together, by
:mod:`distopt.planning.replanning`'s rules), or have joined: a rank that has joined
runs *shadow rounds*, sending zeros, and the contributors' mean is rescaled to count
only them. Waits are watched by the stall inspector (:mod:`distopt.transport.stalls`).

How a pack travels: a pack of one large CPU gradient that is mostly zero rows (an
embedding table's) gathers its non-zero rows instead of all-reducing the whole
(:mod:`distopt.engine.sparse_rows`); a small CPU pack travels once, as one broadcast
from each rank, and is summed locally in rank order (:mod:`distopt.engine.in_flight`).
A compressed pack (:mod:`distopt.compression`) sends its control flags exactly (in its
codec's first collective where that is an all-gather, :mod:`distopt.engine.carrier`) and its
values through its codec, which yields one collective after another: the first is
issued as the pack launches, each later one in the waiting place
(:meth:`GradientEngine._resume_codecs`), pack after pack in the plan's order, so the
ranks' collectives pair up however their timing differs.

The engine knows nothing of optimizers; a mode (:mod:`distopt.modes`) decides what
happens at ``step()``. A mode that keeps gradients local (local SGD) sets
:meth:`GradientEngine.keep_gradients_local`, so backward never reduces, and sends its own values
through the same packs, plan and flags (:meth:`GradientEngine.launch_exchange`).
Streaming local SGD sends one fragment of the model at a time, as a subset of the
packs whose exchange outlives the round (:meth:`GradientEngine.launch_partial`,
:mod:`distopt.engine.partial`): the plan then keeps each fragment's parameters in
packs of their own (:meth:`GradientEngine.set_fragments`).

The engine's state is grouped by lifetime and concern in :mod:`distopt.engine.state`; nothing
outside the engine assigns it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import time
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed
from torch import Tensor
from torch.autograd import Variable

from .. import collectives
from ..compression.protocol import AllGather, AllReduce, AllToAll, Collective, Outcome, Round
from ..planning import replanning
from ..planning.fragments import fragment_of, split_fragments
from ..planning.control import CONTROL_FLAGS, Control, Totals
from ..planning.packing import LaunchOrder
from ..planning.stats import StepStats
from ..transport import stalls, waiting
from ..transport.private_groups import PrivateGroup
from ..transport.stalls import Progress
from . import sparse_rows
from .carrier import Carrier, carries_flags
from .partial import PartialExchange, empty_exchange
from .state import (Announcements, EngineConfig, ExchangeState, JoinState, RoundHooks, RoundOutcome,
                    World)
from .packs import (Pack, adopt_current_grads, build_packs, gather, gather_early, gather_nothing, metas, off_wire,
                    onto_wire, probe_copy, release, scratch, sums, wire_chunks)
from .in_flight import (SCATTER_PARTS, SCATTER_TAG, Sent, broadcast_each, gather_buffer, gather_by_broadcasts,
                        labelled, plan_gathers, scatter_room, scatter_to_owners, sum_copies, sums_by_gather)

__all__ = ["GradientEngine", "RoundState", "Phase", "BACKWARD_PATIENCE", "PATIENCE_GROWTH"]

#: Seconds the end of backward waits at least for the other ranks' gradients before leaving the
#: round pending (finished by synchronize(), step() or zero_grad()). Long enough for a rank that
#: saves a checkpoint or evaluates while the others start the next step.
BACKWARD_PATIENCE = 60.0
#: The patience grows to this many times the slowest wait at the end of backward seen so far, so
#: that slow links do not leave rounds pending.
PATIENCE_GROWTH = 20.0


class RoundState(enum.Enum):
    """Where the reduction round stands (see the module's diagram)."""

    OPEN = "open"  # backward passes accumulate locally; nothing sent
    IN_FLIGHT = "in flight"  # the reducing pass runs: packs launch as they fill
    FLUSHED = "flushed"  # every pack launched; not all back (a round left pending waits here)
    SETTLED = "settled"  # every pack back: gradients averaged and final until the next step


class Phase(enum.IntEnum):
    """Where a rank launched its packs this round; it travels in the control flags.

    An exchange (local SGD) is no gradient round, so it raises neither the "during
    backward" nor the "inside step" flag.
    """

    BACKWARD = 0  # by the hooks, during backward
    EXPLICIT = 1  # by synchronize()
    IMPLICIT = 2  # by step(), because backward reduced nothing
    EXCHANGE = 3  # a mode's exchange of other values (local SGD's pseudo-gradients)


class GradientEngine:
    """Averages the gradients of the parameters it tracks, during backward.

    Its state is grouped by lifetime and concern (:mod:`distopt.engine.state`): the fixed
    :class:`~distopt.engine.state.EngineConfig` and :class:`~distopt.engine.state.World` and
    fault tolerance's :class:`~distopt.engine.state.RoundHooks` are handed in; the join state,
    the last round's outcome, this rank's announcements and a mode's exchange state are its
    own. Nothing outside the engine assigns its attributes: its methods change them, each
    named for what it means.

    Args:
        channel: the private group to reduce over (None in a single process).
        config: how packs travel (op, scale rule, threshold, compressor, ...).
        world: how many ranks a round is averaged over, shared with the wrapper and the mode's
            context (default: a world of the channel's size, else of one).
        backward_passes_per_step: passes accumulated before the reducing one.
        progress: where this rank is, for the stall inspector (None in a single process).
        round_hooks: fault tolerance's say at a round's open and end, or None.
    """

    def __init__(self, *, channel: Optional[PrivateGroup], config: EngineConfig, world: Optional[World] = None,
                 backward_passes_per_step: int = 1, progress: Optional[Progress] = None,
                 round_hooks: Optional[RoundHooks] = None) -> None:
        self.channel = channel
        self.config = config
        self.world = world if world is not None else World(1 if channel is None else channel.group.size())
        self.progress = progress
        self.round_hooks = round_hooks
        self.join = JoinState()
        self.outcome = RoundOutcome(contributors=self.world.size, training=self.world.size)
        self.announcements = Announcements()
        self.exchange = ExchangeState()
        # Called on every rank once a round's control flags are read, at the same point of every rank's
        # collectives (a joined rank's shadow round included): a mode may run collectives of its own there.
        self._on_settled: Optional[Callable[[], None]] = None
        self._probing = False  # a probe round is being sent (see probe())
        self.backward_passes_per_step = backward_passes_per_step
        self.stats = StepStats()
        self.steps = 0  # the owner's steps taken; its parity travels in the control flags
        # Rounds opened so far. Every rank's n-th round pairs with every other rank's n-th (a rank that has
        # joined shadows the others'), so the count is the same on every rank, whatever each rank's own step
        # count: a codec's Round.step, from which its collectives may be decided.
        self.rounds = 0
        self._round_step = 0  # the round being sent: its place among the rounds
        self._slowest_wait = 0.0  # seconds, of the waits at the end of backward that finished
        # The wait at the end of backward: max(backward_patience, patience_growth * slowest wait).
        self.backward_patience = BACKWARD_PATIENCE
        self.patience_growth = PATIENCE_GROWTH
        self.params: List[Tensor] = []
        self.names: List[str] = []
        # Parameters held but frozen when they were tracked; they join once trainable.
        self.frozen: List[Tensor] = []
        self.frozen_names: List[str] = []
        self.handles: List[Any] = []  # hook handles, removed by close() (and while backward never reduces)
        self._hooked: List[int] = []  # the parameters hooked, by index (trainable when tracked)
        self._hooks_on = True
        self.packs: List[Pack] = []
        # shard_state="gradients": each parameter's owning rank in the channel (scatter_to), or None: all-reduced.
        self.owner_of: Optional[Callable[[Tensor], int]] = None
        self._order: List[int] = []  # the order the packs were last planned in
        self.pack_of: List[int] = []  # parameter index -> pack index
        self.slot_of: List[int] = []  # parameter index -> its place in its pack
        self.launch_order = LaunchOrder([])
        self.planned = False
        self.sync_enabled = True  # False inside no_sync()
        self.lock = threading.Lock()
        self.reset_round()

    # ------------------------------------------------------------------ derived from its parts

    @property
    def world_size(self) -> int:
        """Ranks a round is averaged over (:attr:`world`)."""
        return self.world.size

    @property
    def scale(self) -> Optional[float]:
        """Factor applied while copying into a pack (the mean's 1/world), or None."""
        return 1.0 / self.world.size if self.config.scale_mean else None

    # ------------------------------------------------------------------ what its owners change, by name

    def set_world(self, size: int) -> None:
        """``size`` ranks take part in the rounds from now on (fault tolerance: this step's quorum).

        The mean's scale follows (:attr:`scale`).
        """
        self.world.size = size

    def reconfigure(self, **changes: Any) -> None:
        """Change fields of :attr:`config` (:class:`EngineConfig`); a new ``pack_threshold`` takes
        effect at the next plan, so it is set before the parameters are tracked."""
        self.config = dataclasses.replace(self.config, **changes)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before the reducing one, from now on."""
        self.backward_passes_per_step = passes

    def set_steps(self, steps: int) -> None:
        """The owner's step count (a checkpoint, or another rank's count at the end of a join block)."""
        self.steps = steps
        if self.progress is not None:
            self.progress.step = steps

    def reset_stats(self) -> None:
        """Start :attr:`stats` over (a step that sends nothing, unless it syncs)."""
        self.stats = StepStats()

    def stop_inspection(self) -> None:
        """Stop reporting to the stall inspector: waits are plain and nothing is recorded per collective."""
        if self.progress is not None:
            stalls.retire(self.progress)
        self.progress = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and do not count towards a reduction."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    @contextlib.contextmanager
    def announce(self, *, closure: bool = False, leaving: bool = False) -> Iterator[None]:
        """Rounds sent inside carry these announcements in their flags (:class:`Announcements`)."""
        self.announcements.closure, self.announcements.leaving = closure, leaving
        try:
            yield
        finally:
            self.announcements.closure = self.announcements.leaving = False

    def keep_gradients_local(self, local: bool) -> None:
        """Local SGD: backward passes never reduce (and the parameters are not hooked), or reduce again."""
        self.exchange.local = local
        self.hooks(not local)

    def set_shadow_fragment(self, choose: Optional[Callable[[], Optional[int]]]) -> None:
        """As a rank that has joined, ask ``choose`` before each shadow round which fragment the others
        send (None from it: every pack)."""
        self.exchange.shadow_fragment = choose

    def call_when_settled(self, callback: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """Call ``callback`` on every rank once a round's control flags are read (a shadow round's too).

        Returns:
            The callback it replaces (None if none), for a caller that must run it too.
        """
        previous, self._on_settled = self._on_settled, callback
        return previous

    def enter_join(self, divide_by_world: bool) -> Tuple[bool, bool]:
        """Enter a join block: flags say so, and the mean is rescaled to the contributors (over the
        world, counting joined ranks as zeros, with ``divide_by_world``).

        Returns:
            What :meth:`leave_join` restores.
        """
        previous = (self.join.in_block, self.join.divide_by_world)
        self.join.in_block, self.join.divide_by_world = True, bool(divide_by_world)
        return previous

    def leave_join(self, previous: Tuple[bool, bool]) -> None:
        """Leave a join block (``previous``: what :meth:`enter_join` returned)."""
        self.join.in_block, self.join.divide_by_world = previous

    def stop_shadowing(self) -> None:
        """Every rank has joined: this rank no longer sends zeros for the others."""
        self.join.joined = self.join.probed = False
        self.join.shadowed = None

    def after_join(self) -> None:
        """The join block's state is settled on every rank: every rank contributes again, from a new round."""
        self.outcome.contributors = self.outcome.training = self.world.size
        self.outcome.contributed_last = True
        self.outcome.probe = False
        self.reset_round()

    # ------------------------------------------------------------------ set-up

    def track(self, params: Sequence[Tensor], names: Sequence[str]) -> None:
        """Reduce ``params`` (already checked across ranks): the trainable ones now, the frozen once trainable."""
        trainable = [(p, n) for p, n in zip(params, names) if p.requires_grad]
        frozen = [(p, n) for p, n in zip(params, names) if not p.requires_grad]
        self.frozen.extend(p for p, _ in frozen)
        self.frozen_names.extend(n for _, n in frozen)
        self.hook([p for p, _ in trainable], [n for _, n in trainable])

    def hook(self, params: Sequence[Tensor], names: Sequence[str]) -> None:
        ref = weakref.ref(self)
        for index, p in enumerate(params, len(self.params)):
            if p.requires_grad:  # a frozen one with a gradient set by hand is gathered when its pack is sent
                self._hooked.append(index)
                if self._hooks_on:
                    self.handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref, index)))
        self.params.extend(params)
        self.names.extend(names)
        # Reverse registration order is the usual arrival order; the root's observed order replaces it later.
        self.build_packs(list(reversed(range(len(self.params)))))
        self.planned = self.config.fixed_plan
        self.reset_round()

    def hooks(self, on: bool) -> None:
        """Hook the parameters' gradients, or not while no backward pass reduces (local SGD's local steps).

        A hook that finds nothing to do still costs each backward pass a call into Python
        per parameter (a microsecond or two each; too little to show in the benchmark's
        step times, but nothing is gained for it).
        """
        if on == self._hooks_on:
            return
        self._hooks_on = on
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if on:
            # A parameter frozen meanwhile cannot take a hook; should it be trainable again, its gradient
            # is gathered when its pack is sent, as a frozen one's set by hand is.
            ref = weakref.ref(self)
            self.handles.extend(self.params[i].register_post_accumulate_grad_hook(_make_hook(ref, i))
                                for i in self._hooked if self.params[i].requires_grad)

    def close(self) -> None:
        """Remove every hook and destroy the private group: nothing is reduced any more."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.progress is not None:
            stalls.retire(self.progress)
        if self.channel is not None:
            self.channel.destroy()

    def scatter_to(self, owner_of: Callable[[Tensor], int]) -> None:
        """Reduce-scatter every pack to the owners of its members (``owner_of``: a parameter's rank in the
        channel, the same on every rank) instead of all-reducing it; re-plans at once, in the plan's order.
        Each pack's members are grouped by owner, and its flags travel in an all-reduce of their own. After
        a round a gradient is the average only on its owner (the others' chunks hold their own sums)."""
        self.owner_of = owner_of
        if self.params:
            self.build_packs(self._order)

    def build_packs(self, order: Sequence[int]) -> None:
        groups = self._fragment_groups()
        self._order = list(order)
        owners = None
        if self.owner_of is not None and self.channel is not None:
            owners = [self.owner_of(p) for p in self.params]
        packs = build_packs(self.params, self.names, order, self.config.pack_threshold, self.config.compressor, groups,
                            owners, self.channel.group.size() if self.channel is not None else 1)
        for pack in packs:
            # Not a gradient reduce-scattered to its owner: its rows would reach every rank, and a round
            # whose rows overflow would all-reduce it, where the owner alone needs it.
            if pack.direct and pack.owner is None and self.config.rows and self.channel is not None:
                pack.rows = sparse_rows.plan_rows(pack.params[0], self.world_size, self.channel.group.rank())
        planned = [(pack, nbytes) for pack in packs for nbytes in sums(pack)]
        for (pack, nbytes), gathers in zip(planned, plan_gathers([(n, p.spec.key[0]) for p, n in planned],
                                                                 self.world_size)):
            if gathers:
                pack.gathers.add(nbytes)
        if self.packs:  # a re-plan: gradients move from the old buffers to the new ones
            adopt_current_grads(packs)
        self.packs = packs
        self.pack_of = [0] * len(self.params)
        self.slot_of = [0] * len(self.params)
        for k, pack in enumerate(packs):
            for j, i in enumerate(pack.spec.members):
                self.pack_of[i] = k
                self.slot_of[i] = j
        self.launch_order = LaunchOrder([len(pack.spec.members) for pack in packs])
        fragment = [0 if groups is None else groups[pack.spec.members[0]] for pack in packs]
        self.exchange.fragment_packs = [[k for k, f in enumerate(fragment) if f == g] for g in range(max(fragment, default=-1) + 1)]

    def _fragment_groups(self) -> Optional[List[int]]:
        """Each tracked parameter's fragment, or None for one fragment (the plan as without streaming)."""
        if self.exchange.fragments == 1:
            return None
        return fragment_of(split_fragments([p.numel() * p.element_size() for p in self.params], self.exchange.fragments))

    def set_fragments(self, fragments: int) -> None:
        """Keep the parameters of each of ``fragments`` fragments in packs of their own, from now on.

        Re-plans at once, in the plan's present order (every rank alike: the plan is the same
        on every rank, and so are the parameters' sizes).
        """
        if fragments == self.exchange.fragments:
            return
        self.exchange.fragments = fragments
        if self.params:
            self.build_packs([i for pack in self.packs for i in pack.spec.members])

    # ------------------------------------------------------------------ the round

    def reset_round(self) -> None:
        """Start a new round: nothing fired, nothing in flight."""
        self.state = RoundState.OPEN
        self._passes = 0
        self._pass_open = False
        self._pass_counts = False
        self._pass_reduces = False
        # A backward pass is open that reduces nothing (local SGD, no_sync, accumulation): the
        # parameters' hooks return at once, without the lock (~5 us a parameter on CPU).
        self.quiet = False
        self.inflight: List[Sent] = []
        self._fired = bytearray(len(self.params))
        self.arrivals: List[int] = []
        self._phase = Phase.BACKWARD
        self._pending_versions: Optional[List[int]] = None
        self._pending_grads: Optional[List[Optional[Tensor]]] = None  # each .grad when the round was left pending
        self._touched = False  # gradients changed while the round was pending
        self._patience_used = 0.0
        self._control: Optional[Tensor] = None  # this rank's control flags, set at its first launch
        # After a step: each gradient then, and its pack's version, so that a synchronize() or step()
        # with nothing new sends nothing, rather than the averaged gradients a second time.
        self._consumed: Optional[Any] = None
        self.launch_order.reset()
        for pack in self.packs:
            pack.absent.clear()
            pack.moved.clear()
            if pack.direct:
                release(pack)  # else last round's gradient stays alive beside autograd's next one
        if self.progress is not None:
            self.progress.phase = "before backward"

    def open_round(self, phase: int) -> None:
        """Begin counting a round launched outside backward (``phase`` says where, for the control flags)."""
        self.stats = StepStats()
        self._phase = phase
        self._next_round()
        if self.round_hooks is not None:  # fault tolerance: the step's quorum, which sets the world
            self.round_hooks.enter_round()

    def _next_round(self) -> None:
        """A round opens (on every rank, shadow rounds included): it takes the next place among the rounds."""
        self._round_step = self.rounds
        self.rounds += 1

    def expected_factor(self) -> float:
        """What this round's mean will be rescaled by, as the last round's flags said (every rank alike):
        ``world / contributors`` inside a join block once ranks have joined, else 1.

        Only a join changes it, and only learned from a round's flags; outside join blocks every rank
        contributes, so it is 1 (under fault tolerance the world is the quorum of each step).
        """
        count = self.outcome.contributors
        if not self.join.in_block or not self.config.mean or self.join.divide_by_world or count in (0, self.world_size):
            return 1.0
        return self.world_size / count

    def forbid_rows(self) -> None:
        """Never send a gradient as its rows (a mode that exchanges parameters).

        A rank that has joined sends zeros in the shape of whatever the others send, and
        cannot tell an exchange (always dense) from a gradient round (rows, where they pay).
        """
        self.reconfigure(rows=False)
        for pack in self.packs:
            pack.rows = None

    def synchronize(self, explicit: bool) -> None:
        """Reduce whatever is not reduced yet this round and wait for it; a no-op once SETTLED.

        Args:
            explicit: the user asked for it (``synchronize()``), rather than ``step()``
                reducing what backward did not.
        """
        if self.state == RoundState.SETTLED or (self.state == RoundState.OPEN and self._unchanged_since_step()):
            return
        with self.lock:
            if self.state == RoundState.OPEN:  # else the round is pending: launched in backward, still in flight
                self.open_round(Phase.EXPLICIT if explicit else Phase.IMPLICIT)
            if not self.packs:
                self.control_round()
                return
            self.flush()
            self.finish_round()

    def on_grad_ready(self, index: int) -> None:
        with self.lock:
            if not self._pass_open:
                self._open_pass(index)
            if not self._pass_reduces:
                return
            if self._fired[index]:
                raise RuntimeError(
                    f"the gradient of {self.names[index]!r} was accumulated twice in one backward pass "
                    "after it was sent; distopt supports one gradient per parameter per backward"
                )
            self._fired[index] = 1
            if not self.planned:
                self.arrivals.append(index)
            pack = self.packs[self.pack_of[index]]
            if not pack.batched and not pack.direct:
                gather_early(pack, self.slot_of[index], self.scale, self.config.sparse_as_dense)
            for ready in self.launch_order.ready(self.pack_of[index]):
                self._launch(ready)

    def _open_pass(self, index: int) -> None:
        """First hook of a backward pass: decide whether it reduces, and hook its end."""
        if self.state == RoundState.SETTLED and self._cleared_since_round(index):
            self.reset_round()  # e.g. model.zero_grad() after a step GradScaler skipped
        self._consumed = None
        if self._passes >= self.backward_passes_per_step or self.state == RoundState.SETTLED:
            raise RuntimeError(
                f"backward() ran again after the gradients were averaged (backward_passes_per_step="
                f"{self.backward_passes_per_step}): call step() or zero_grad() before the next backward(), "
                f"or raise backward_passes_per_step to accumulate more passes (a reentrant "
                f"torch.utils.checkpoint also runs nested backward passes: use use_reentrant=False)"
            )
        self._pass_open = True
        self._pass_counts = self.sync_enabled and not self.exchange.local  # no_sync and local passes do not count
        self._pass_reduces = self._pass_counts and self._passes == self.backward_passes_per_step - 1
        self.quiet = not self._pass_reduces
        if self._pass_reduces:
            self.state = RoundState.IN_FLIGHT
            self.stats = StepStats()
            self._next_round()
            if self.round_hooks is not None:  # fault tolerance: the step's quorum, which sets the world
                self.round_hooks.enter_round()
        if self.progress is not None:
            self.progress.phase = "in backward" if self._pass_reduces else "in backward (accumulating locally)"
        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        with self.lock:
            self._pass_open = False
            self.quiet = False
            self._passes += self._pass_counts
            if self._pass_reduces:
                self.flush()
                # A rank whose backward reached no parameter sends its packs only in step(); waiting for
                # them here without bound would deadlock with a collective it runs before step().
                self.finish_round(patience=self.patience())

    def patience(self) -> float:
        """Seconds the end of backward waits for the other ranks before leaving the round pending."""
        return max(self.backward_patience, self.patience_growth * self._slowest_wait)

    def _control_flags(self) -> Tensor:
        if self._control is None and self._probing:  # contributing, and nothing else to say (see probe())
            self._control = Control(during_backward=False, inside_step=False, unfrozen=False, contributing=True,
                                    in_join=self.join.in_block, divide_by_world=self.join.divide_by_world,
                                    probe=True).tensor()
        if self._control is None:
            self._control = Control(
                during_backward=not self.join.joined and self._phase == Phase.BACKWARD,
                inside_step=not self.join.joined and self._phase == Phase.IMPLICIT,
                unfrozen=not self.join.joined and any(p.requires_grad or p.grad is not None for p in self.frozen),
                contributing=not self.join.joined,
                in_join=self.join.in_block,
                divide_by_world=self.join.divide_by_world,
                # An exchange (local SGD) meets a rank leaving a join block at its own step count.
                counts_steps=not self.join.joined and self._phase != Phase.EXCHANGE,
                odd_steps=not self.join.joined and self._phase != Phase.EXCHANGE and self.steps % 2 == 1,
                closure=not self.join.joined and self.announcements.closure,
                leaving=not self.join.joined and self.announcements.leaving,
            ).tensor()
        return self._control

    def _launch(self, index: int) -> None:
        pack = self.packs[index]
        # Exchanged values (local SGD) are not sparse: only gradients travel as rows.
        rows = pack.rows if pack.rows is not None and pack.rows.cap and self.exchange.fill is None else None
        if rows is None and pack.rows is not None and self.exchange.fill is None:
            sparse_rows.dense_round(pack.rows)  # sent densely this round; rows again once the wait is over
        if self.join.joined or self._probing:
            gather_nothing(pack)
        else:
            if self.exchange.fill is not None:
                scratch(pack)
                self.exchange.fill(pack)
            else:  # rows are scaled as they are picked, not the whole gradient
                gather(pack, self.scale if rows is None else None, self.config.sparse_as_dense)
            pack.flags.fill_(1)
            for j in pack.absent:
                pack.flags[j] = 0
        pack.flags[-CONTROL_FLAGS:].copy_(self._control_flags())
        onto_wire(pack)
        with labelled("distopt.all_reduce"):
            if rows is not None:
                self._gather_rows(rows, pack, index)
                self._send(pack.flags, pack, index, carries_flags=True)
            elif pack.direct and pack.owner is not None:  # the gradient to its owner, from where autograd left it
                self._send(pack.flags, pack, index, carries_flags=True)
                data = pack.data.view(-1)
                self._scatter(pack, [data if r == pack.owner else data[:0] for r in range(self.channel.group.size())],
                              index)
            elif pack.direct:
                self._send(pack.data, pack, index, carries_flags=False)
                self._send(pack.flags, pack, index, carries_flags=True)
            elif pack.chunks is not None:  # to the owners; the flags apart, every rank reads them
                self._send(pack.flags, pack, index, carries_flags=True)
                self._scatter(pack, pack.chunks, index)
            elif pack.codec is not None:  # the flags exactly, the values as the codec sends them
                contributing = (not self.join.joined and not self._probing
                                and (self.round_hooks is None or self.round_hooks.participating))
                if not contributing:
                    pack.data.zero_()  # what Round.contributing=False promises the codec
                group = self.channel.group
                outcome = Outcome()  # filled in once the flags are back, before the codec resumes (_fill_outcome)
                codec = pack.codec.reduce(pack.data, Round(
                    rank=group.rank(), world_size=group.size(),
                    step=self._round_step if self.round_hooks is None else self.round_hooks.quorum_step,
                    contributing=contributing, exchange=self.exchange.fill is not None,
                    contributors=self.world_size, factor=self.expected_factor(), outcome=outcome))
                self._resume_codec(codec, pack, index, first=True, outcome=outcome)
            else:
                self._send(pack.buffer if pack.wire is None else pack.wire, pack, index, carries_flags=True)
        self.stats.packs += 1

    def _send(self, tensor: Tensor, pack: Pack, index: int, carries_flags: bool) -> None:
        # The group's own methods, as DDP's reducer calls them: dist.all_reduce's Python layer costs
        # ~20 µs a call and does nothing a private group needs.
        flat = torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor
        nbytes = flat.numel() * flat.element_size()
        copies = None
        if (self.config.op == dist.ReduceOp.SUM and nbytes in pack.gathers
                and sums_by_gather(nbytes, self.world_size, flat.device, self.config.gather_sum_limit)):
            copies = gather_buffer(pack, flat, self.world_size, flags=carries_flags)
            work = gather_by_broadcasts(self.channel.group, copies, flat, self.world_size)
        else:
            options = dist.AllreduceOptions()
            options.reduceOp = self.config.op
            options.asyncOp = True
            work = self.channel.group.allreduce([flat], options)
        seq = self.progress.issue() if self.progress is not None else 0
        self.inflight.append(Sent(work, pack, index, seq, carries_flags, copies=copies,
                                  into=None if copies is None else flat))
        self.stats.all_reduces += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()

    def _scatter(self, pack: Pack, chunks: List[Tensor], index: int) -> None:
        """Reduce-scatter ``pack``'s gradients: each rank's chunk (of ``chunks``, the pack's, in rank order)
        arrives summed on that rank, in place, the copies added in rank order as they arrive, part by part
        (:func:`scatter_to_owners`); ``opt.stats.all_reduces`` counts it."""
        group = self.channel.group
        rank = group.rank()
        into = None
        if pack.wire is not None:  # a cast: the chunks travel, and wait in the room, in the wire dtype
            into, chunks = chunks[rank], wire_chunks(pack, chunks)
        mine = chunks[rank]
        room = pack.scattered
        size = scatter_room(mine, group.size())
        if room is None or room.numel() != size or room.dtype != mine.dtype:
            room = pack.scattered = torch.empty(size, dtype=mine.dtype, device=mine.device)
        work = scatter_to_owners(group, chunks, room, SCATTER_TAG + index * SCATTER_PARTS, into)
        seq = self.progress.issue() if self.progress is not None else 0
        self.inflight.append(Sent(work, pack, index, seq, carries_flags=False))
        self.stats.all_reduces += 1
        # What leaves this rank: every other rank's chunk, once, to its owner, as it travels.
        self.stats.bytes += (sum(c.numel() for c in chunks) - mine.numel()) * mine.element_size()

    def _resume_codec(self, codec: Iterator[Collective], pack: Pack, index: int, after_last: bool = False,
                      first: bool = False, outcome: Optional[Outcome] = None) -> bool:
        """Run a compressed pack's codec up to its next collective and issue that; False once it is done.

        Args:
            first: the codec's first collective, as the pack launches: the pack's flags go with it
                where it can carry them (:mod:`distopt.engine.carrier`), else in a collective of
                their own, issued just before it.
            outcome: the codec's :attr:`Round.outcome`, filled in before it is resumed (:meth:`_fill_outcome`).

        Raises:
            TypeError: the codec yielded a collective after one it marked ``last``.
        """
        collective = next(codec, None)
        group = self.channel.group
        carrier = None
        if first:
            if collective is not None and carries_flags(collective, pack.flags, group.size()):
                carrier = pack.carrier = Carrier.fitting(pack.carrier, pack.flags, collective.tensor, group.size())
            else:
                self._send(pack.flags, pack, index, carries_flags=True)
        if collective is None:
            return False
        if after_last:
            codec.close()
            raise TypeError(f"a codec of {type(self.config.compressor).__name__} yielded {type(collective).__name__} after "
                            "a collective it marked last=True; mark only the codec's final collective last")
        if isinstance(collective, AllReduce):
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            sent = collective.tensor
            work = group.allreduce([sent], options)
        elif carrier is not None:
            carrier.fill(pack.flags, collective.tensor)
            sent = carrier.send
            work = group.allgather([list(carrier.rows)], [sent], AllgatherOptions())
        elif isinstance(collective, AllGather):
            sent = collective.tensor
            work = group.allgather([list(collective.out.view(group.size(), -1))], [sent], AllgatherOptions())
        elif isinstance(collective, AllToAll):
            sent = collective.tensor
            work = group.alltoall_base(collective.out, sent, [], [], dist.AllToAllOptions())
        else:
            raise TypeError(f"a codec of {type(self.config.compressor).__name__} yielded {collective!r}; a codec yields "
                            "distopt.compression.AllReduce, AllGather or AllToAll")
        seq = self.progress.issue() if self.progress is not None else 0
        self.inflight.append(Sent(work, pack, index, seq, carries_flags=carrier is not None, codec=codec,
                                  last=collective.last, carrier=carrier, gathered_into=None if carrier is None else
                                  collective.out, outcome=outcome))
        self.stats.all_reduces += 1
        self.stats.bytes += sent.numel() * sent.element_size()
        return True

    def _gather_rows(self, rows: sparse_rows.RowSparse, pack: Pack, index: int) -> None:
        send = sparse_rows.fill(rows, pack.data, self.row_scale)
        work = broadcast_each(self.channel.group, list(rows.recv.view(self.world_size, -1)))
        seq = self.progress.issue() if self.progress is not None else 0
        self.inflight.append(Sent(work, pack, index, seq, carries_flags=False, gathered=True))
        self.stats.gathers += 1
        self.stats.bytes += send.numel()

    @property
    def row_scale(self) -> Optional[float]:
        """What a gradient's rows are multiplied by before they are summed: the mean's 1/world."""
        if self.scale is not None or not self.config.mean:
            return self.scale
        return 1.0 / self.world_size  # the backend averages dense all-reduces (AVG); gathers do not

    def reduce_again(self) -> None:
        """Send every pack once more and wait (after a re-plan, inside a finished round)."""
        self.state = RoundState.IN_FLIGHT
        self.flush()
        self.finish_round()

    def flush(self) -> None:
        """Launch every pack not launched yet, sending zeros for members without a gradient."""
        launched_before = self.launch_order.launched
        for k in self.launch_order.flush():
            self._launch(k)
        self.stats.packs_at_flush += self.launch_order.launched - launched_before
        self.state = RoundState.FLUSHED

    def wait(self, patience: Optional[float] = None) -> bool:
        """Block until every launched all-reduce is done (their buffers may be written until then).

        Args:
            patience: give up after this many seconds. CUDA packs (NCCL) ignore it: their plain
                wait only orders the streams, while a wait with a timeout would block the host.

        Returns:
            False if it gave up: the all-reduces go on, and a later wait finishes them.

        Raises:
            StallError: a pack took longer than the stall timeout.
            RuntimeError: a peer went away; the error says which and how.
        """
        if not self.inflight:
            return True
        start = time.perf_counter()
        try:
            kind = ("probe round of check_drift() inside a join block" if self._probing
                    else "parameter exchange (local SGD)" if self._phase == Phase.EXCHANGE else "gradient all-reduce")
            deadline = None if patience is None else start + patience
            with labelled("distopt.wait"):
                for sent in self.inflight:
                    what = f"pack {sent.index + 1}/{len(self.packs)} of the {kind}"
                    if not waiting.wait_for(sent.work, sent.pack.buffer.is_cuda, self.progress, sent.seq, what,
                                            deadline, from_every_rank=True):
                        return False
            return True
        finally:
            self.stats.wait_seconds += time.perf_counter() - start

    def finish_round(self, patience: Optional[float] = None) -> None:
        """Wait for every pack, scale, and settle which parameters end up with a gradient.

        Args:
            patience: seconds to wait before leaving the round pending, to be finished by
                the next ``synchronize()``, ``step()`` or ``zero_grad()``.

        Raises:
            RuntimeError: the ranks are not in step (see :meth:`distopt.planning.control.Totals.check`),
                or gradients were changed while the round was pending.
            ValueError: the ranks unfroze different parameters.
        """
        start = time.perf_counter()
        if not self._arrive(patience):
            return
        if self.round_hooks is not None and self.round_hooks.round_failed():
            self._discard_failed_round()
            return
        if patience is not None:
            self._slowest_wait = max(self._slowest_wait, time.perf_counter() - start)
        touched, self._touched = self._touched, False
        totals = self._read_back()
        self.inflight = []
        self.state = RoundState.SETTLED
        self._passes = self.backward_passes_per_step
        if self.progress is not None:
            self.progress.phase = "after backward, before step()"
        if totals is None:
            return
        totals.check(self.world_size if self.config.flags_from_all else None)
        if touched:
            raise RuntimeError(_TOUCHED_WHILE_PENDING.format(self._patience_used))
        if totals.probe:
            self._shadowed_probe()
            return
        self._settle(totals)
        if self._on_settled is not None:
            self._on_settled()

    def _read_back(self) -> Optional[Totals]:
        """Everything in flight is back: take the values off the wire, read the control flags, rescale
        the mean to the contributors, and leave members no rank had without a gradient.

        Returns:
            The flags' totals, or None if no collective carried flags.
        """
        totals = None
        for sent in self.inflight:
            if not sent.carries_flags:
                continue
            pack = sent.pack
            off_wire(pack)
            if totals is None:
                totals = self._totals(pack.flags[-CONTROL_FLAGS:].tolist())
            factor = totals.rescale(self.world_size, self.config.mean)
            if factor != 1.0:
                pack.data.mul_(factor)
            if pack.absent:
                # An exchange's values are not gradients: which members no rank sent is the mode's to read
                # from the presence flags (local SGD: a frozen parameter has no pseudo-gradient).
                if self._phase != Phase.EXCHANGE:
                    present = pack.flags.tolist()
                    for j in pack.absent:
                        # Averaged with zeros where some rank had a gradient; None where none had.
                        index = pack.spec.members[j]
                        self.params[index].grad = pack.views[j] if present[j] else None
                pack.absent.clear()
        if self.owner_of is not None and self._phase != Phase.EXCHANGE:
            self._drop_foreign_grads()
        return totals

    def _drop_foreign_grads(self) -> None:
        """After a reduce-scatter to the owners: a parameter another rank owns has no gradient here (this
        rank's chunk of it is its own sum, not the average), and a direct pack's gradient is let go at once."""
        rank = self.channel.group.rank()
        for pack in self.packs:
            if pack.direct:
                if pack.owner is not None and pack.owner != rank:
                    pack.params[0].grad = None
                    release(pack)
            elif pack.chunks is not None:
                for p in pack.params:
                    if self.owner_of(p) != rank:
                        p.grad = None

    def _discard_failed_round(self) -> None:
        """Fault tolerance: a collective of this round failed; its values and flags are garbage and are
        not read (the step is discarded on every replica that saw the failure, and a replica that did
        not heals from one that did at the next quorum)."""
        self.inflight = []
        self._touched = False
        self.state = RoundState.SETTLED
        self._passes = self.backward_passes_per_step

    def _arrive(self, patience: Optional[float]) -> bool:
        """Wait for everything in flight and complete it: add up the gathered copies of small
        sums, sum the gathered rows, and all-reduce densely (then wait for) each gradient whose
        rows overflowed somewhere. False if it gave up: the round stays pending, and a later
        call goes on from where this one stopped."""
        deadline = None if patience is None else time.perf_counter() + patience
        while True:
            if not self.wait(None if deadline is None else max(deadline - time.perf_counter(), 0.0)):
                # Remember the buffers' versions and the gradients themselves: changing a gradient
                # before it is averaged, in place or by setting another, is an error.
                self._pending_versions = [_written(sent.pack)._version for sent in self.inflight]
                self._pending_grads = [p.grad for p in self.params]
                self._patience_used = patience
                return False
            if self._pending_versions is not None:
                self._touched |= any(_written(sent.pack)._version != version
                                     for sent, version in zip(self.inflight, self._pending_versions))
                self._touched |= any(p.grad is not grad for p, grad in zip(self.params, self._pending_grads))
                self._pending_versions = self._pending_grads = None
            overflowed = False
            self._sum_copies()  # first: a compressed pack's flags may be among them, for its codec to resume with
            resumed = self._resume_codecs()
            for k, sent in list(enumerate(self.inflight)):
                if sent.gathered:
                    self.inflight[k] = sent._replace(gathered=False)
                    if not sparse_rows.settle(sent.pack.rows, sent.pack.data):
                        # Some rank had more rows than the gather held: the gradient (this rank's
                        # own, unscaled) is all-reduced instead, watched and bounded like the rest.
                        if self.scale is not None:
                            sent.pack.data.mul_(self.scale)
                        self._send(sent.pack.data, sent.pack, sent.index, carries_flags=False)
                        overflowed = True
            if not overflowed and not resumed:
                return True

    def _sum_copies(self) -> None:
        """Add up the gathered copies of the small sums that are back (all of those in flight)."""
        for k, sent in enumerate(self.inflight):
            if sent.copies is not None:
                sum_copies(sent.copies, sent.into, self.channel.group.rank(), self.world_size)
                self.inflight[k] = sent._replace(copies=None, into=None)

    def _fill_outcome(self, sent: Sent) -> None:
        """Tell a codec what its round's flags say (:class:`Outcome`), before it is resumed after its first
        collective: the pack's flags are back and summed by then (carried in that collective, or sent just
        before it). Outside a join block every rank contributes and nothing is read."""
        outcome = sent.outcome
        if outcome is None or outcome.factor is not None:
            return
        if not self.join.in_block:
            outcome.contributors, outcome.factor = self.world_size, 1.0
            return
        totals = Totals.read(sent.pack.flags[-CONTROL_FLAGS:].tolist(), self.world_size,
                             averaged=self.config.op == dist.ReduceOp.AVG)
        outcome.contributors, outcome.factor = totals.contributing, totals.rescale(self.world_size, self.config.mean)
        if totals.contributing:  # contributors count their steps in gradient rounds only, never in an exchange
            outcome.exchange = not totals.counts_steps

    def _resume_codecs(self) -> bool:
        """Every compressed pack's codec on to its next collective, pack after pack in the plan's
        order: the same order on every rank, whichever of its collectives came back first."""
        codecs = [sent for sent in self.inflight if sent.codec is not None]
        if not codecs:
            return False
        self.inflight = [sent for sent in self.inflight if sent.codec is None]
        if self.round_hooks is not None and self.round_hooks.round_failed():
            # Fault tolerance: what came back is garbage and the step is discarded; a codec resumed
            # would compute on it and issue collectives that cannot pair up any more.
            for sent in codecs:
                sent.codec.close()
            return False
        for sent in codecs:
            if sent.carrier is not None:  # the codec's parts out, the flags summed; the flags stay to be read back
                sent.carrier.unpack(sent.pack.flags, sent.gathered_into, averaged=self.config.op == dist.ReduceOp.AVG)
                self.inflight.append(sent._replace(codec=None, carrier=None, gathered_into=None, last=False))
            self._fill_outcome(sent)
            self._resume_codec(sent.codec, sent.pack, sent.index, after_last=sent.last, outcome=sent.outcome)
        return True

    def _totals(self, flags: List[float]) -> Totals:
        totals = Totals.read(flags, self.world_size, averaged=self.config.op == dist.ReduceOp.AVG)
        self.outcome.probe = bool(totals.probe)
        if totals.probe:  # says nothing of the rounds: the outcome stays the last round's
            return totals
        self.outcome.closure = bool(totals.closure)
        self.outcome.training = totals.training
        if totals.contributing:
            self.outcome.contributors = totals.contributing
            self.outcome.contributed_last = not self.join.joined
        else:
            self.outcome.contributors = 0
        return totals

    def _shadowed_probe(self) -> None:
        """The round back was the others' probe (:meth:`probe`), which this rank shadowed: nothing is settled
        and nothing follows it. It takes no place among the rounds, as on the ranks that sent it, and a rank
        that has joined shadows the same packs again next (the others' round it was waiting for is still due)."""
        if self.join.joined:
            self.rounds -= 1
            self.join.probed = True

    def _settle(self, totals: Totals) -> None:
        if totals.unfrozen:
            self._adopt_unfrozen()
        elif not self.planned and totals.counts_steps:
            # Only a gradient round observed an order. Not after an exchange: a streaming exchange
            # settles steps after it was sent, and a rank leaving sends several at once, so a
            # broadcast here would meet the others' collectives in another order.
            self._fix_plan()

    # ------------------------------------------------------------------ between rounds

    def after_step(self) -> None:
        """The inner optimizer stepped: a new round starts, with nothing new to send until a gradient changes."""
        done = self.state == RoundState.SETTLED
        self.reset_round()
        if done and self.channel is not None:
            self._consumed = ([p.grad for p in self.params], self._grad_versions())

    def _grad_versions(self) -> List[int]:
        # Per pack, not per gradient: a gradient is a view of its pack's buffer, and views share
        # their base's version counter; a direct pack's gradient is its own tensor.
        versions = []
        for pack in self.packs:
            t = pack.params[0].grad if pack.direct else pack.buffer
            versions.append(-1 if t is None else t._version)
        return versions

    def _unchanged_since_step(self) -> bool:
        """Every gradient is the one the last step read, unchanged, and no frozen parameter got one."""
        if self._consumed is None:
            return False
        grads, versions = self._consumed
        return (len(grads) == len(self.params) and all(p.grad is g for p, g in zip(self.params, grads))
                and versions == self._grad_versions() and all(p.grad is None for p in self.frozen))

    def _cleared_since_round(self, index: int) -> bool:
        """Whether the gradients were cleared behind the wrapper's back since the round ended.

        Called at the first hook of a backward pass after a finished round: when every
        other tracked gradient is None or zero (``model.zero_grad()``, e.g. after a step
        GradScaler skipped), this pass starts a new round instead of being refused.
        """
        with torch.no_grad():
            for i, p in enumerate(self.params):
                g = p.grad
                if i != index and g is not None and (g.is_sparse or bool(g.any())):
                    return False
        return True

    def control_round(self) -> None:
        """A round without packs (nothing trainable yet): only the control flags travel."""
        flags = self._control_flags().clone()
        with stalls.inspected(self.progress, "the control flags (no trainable parameter yet)"):
            collectives.all_reduce(flags, op="sum", group=self.channel.group)
        self.state = RoundState.SETTLED
        totals = self._totals(flags.tolist())
        totals.check(self.world_size if self.config.flags_from_all else None)
        if totals.probe:
            self._shadowed_probe()
            return
        if totals.unfrozen:
            self._adopt_unfrozen()
        if self._on_settled is not None:
            self._on_settled()

    # ------------------------------------------------------------------ replanning, on every rank together

    def _fix_plan(self) -> None:
        """Adopt the root's observed gradient order as the plan on every rank.

        The message starts with how many arrivals the root saw: a round without
        any (gradients set by hand, or a root that has joined) leaves the plan open.
        """
        order = replanning.observed_order(self.arrivals, len(self.params))
        message = torch.tensor([len(self.arrivals)] + order, dtype=torch.int64)
        with stalls.inspected(self.progress, "the broadcast of the pack plan"):
            collectives.broadcast(message, src=self.config.root_rank, group=self.channel.group)
        observed, *root_order = message.tolist()
        if not observed:
            return
        if replanning.replan([pack.spec for pack in self.packs], root_order, metas(self.params),
                             self.config.pack_threshold, self._fragment_groups()) is not None:
            self.build_packs(root_order)
        self.planned = True

    def _adopt_unfrozen(self) -> None:
        """Track the parameters every rank unfroze, and reduce this round again with them.

        A rank that has joined sends None and follows the others.

        Raises:
            ValueError: the ranks unfroze different parameters.
        """
        frozen, frozen_names = self.frozen, self.frozen_names
        # A frozen parameter with a gradient set by hand (torch.func.grad, say) is stepped by the inner
        # optimizer like a trainable one, so it is averaged like one.
        mine: replanning.Unfrozen = None if self.join.joined else [
            (n, "trainable" if p.requires_grad else "frozen, with a gradient set by hand")
            for p, n in zip(frozen, frozen_names) if p.requires_grad or p.grad is not None
        ]
        with stalls.inspected(self.progress, "the exchange of unfrozen parameter names"):
            everyone = collectives.all_gather_object(mine, group=self.channel.group)
        adopted = replanning.agree_on_unfrozen(everyone)
        if mine is None:
            for p, n in zip(frozen, frozen_names):
                if adopted.get(n) == "trainable":
                    p.requires_grad_(True)
        track, stay = replanning.split_frozen(frozen_names, adopted)
        self.frozen = [frozen[k] for k in stay]
        self.frozen_names = [frozen_names[k] for k in stay]
        # The other gradients are averaged already. The round is sent again in the new plan, for the
        # unfrozen ones, and then the others get their averaged values back: sent again, a sum
        # would be summed twice and a join's rescale applied twice. A copy of them, once per unfreeze.
        final = [(p, p.grad.detach().clone()) for p in self.params if p.grad is not None]
        self.hook([frozen[k] for k in track], [frozen_names[k] for k in track])  # re-plans; gradients move
        self.reduce_again()
        for p, grad in final:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)

    # ------------------------------------------------------------------ exchanges (a mode's values, not gradients)

    def launch_exchange(self, fill: Callable[[Pack], None]) -> None:
        """Start a round that sends what ``fill`` writes into each pack instead of gradients.

        An exchange is a round like a gradient round: the same packs, the same plan
        order, the same control flags. So a rank that has joined shadows it like any
        round, and the contributors' mean is rescaled to count only them.

        Args:
            fill: called with each pack, in plan order, as it launches; it writes the
                values into the pack's member views and must apply :attr:`scale` itself,
                and lists in ``pack.absent`` the members it sends no value for (their presence
                flags: once back, ``pack.flags[j]`` is 0 where no rank sent one).
                Finish with :meth:`finish_exchange`.
        """
        with self.lock:
            self.open_round(Phase.EXCHANGE)
            self.exchange.fill = fill
            self.state = RoundState.IN_FLIGHT
            # An exchange fixes no plan (_settle): its order is the plan's present one, on every rank.
            if self.packs:
                self.flush()

    def finish_exchange(self) -> None:
        """Wait for the exchange :meth:`launch_exchange` started; each pack's ``data`` then holds the mean."""
        with self.lock:
            try:
                if self.packs:
                    self.finish_round()
                else:  # nothing trainable: only the control flags travel, as a joined rank's shadow does
                    self.control_round()
            finally:
                self.exchange.fill = None

    # ------------------------------------------------------------------ partial exchanges (streaming: one fragment)

    def launch_partial(self, packs: Sequence[int], fill: Callable[[Pack], None]) -> PartialExchange:
        """Start an exchange of the packs at ``packs`` (one fragment's) that stays in flight across steps.

        Each pack launches as in a round (:meth:`launch_exchange`: the same collectives, codec and
        control flags, this rank contributing), in the order given, which must be the plan's. Its
        collectives are not the round's: ``reset_round()`` and ``after_step()`` leave them alone, and
        inner steps (local backward passes, which never reduce) go on while they travel. Finish it
        with :meth:`finish_partial`; meanwhile the packs' buffers belong to it.

        Args:
            packs: places in the plan, ascending (``exchange.fragment_packs``).
            fill: writes the values into each pack's member views, scaled by :attr:`scale`.

        Returns:
            The exchange, for :meth:`arrive_partial` and :meth:`finish_partial`.
        """
        with self.lock:
            round_state = (self.inflight, self._control, self._phase, self.exchange.fill, self._round_step)
            self._next_round()
            if not self.packs:  # nothing trainable: the flags travel, at once, as a joined rank's shadow does
                self.control_round()
                return empty_exchange()
            self.inflight, self._control, self._phase, self.exchange.fill = [], None, Phase.EXCHANGE, fill
            try:
                for k in packs:
                    self._launch(k)
                held = [(self.packs[k], self.packs[k].data, list(self.packs[k].views)) for k in packs]
                return PartialExchange(list(packs), self.inflight, held)
            finally:
                self.inflight, self._control, self._phase, self.exchange.fill, self._round_step = round_state

    def arrive_partial(self, exchange: PartialExchange) -> None:
        """Wait for ``exchange``'s collectives; its values are then the mean over the contributors.

        Communicates nothing of its own (a codec's later stages aside, which every rank runs for
        its packs), so one rank may call it alone, e.g. to save a checkpoint; what the flags
        say is acted on by :meth:`finish_partial`, which every rank calls at the same point.
        """
        with self.lock:
            if exchange.arrived:
                return
            for pack, data, views in exchange.held:
                pack.data, pack.views = data, views  # a one-parameter pack's were let go at the round's end
            round_state = (self.inflight, self._phase)
            self.inflight, self._phase = exchange.sent, Phase.EXCHANGE
            try:
                self._arrive(None)
                exchange.totals = self._read_back()
            finally:
                self.inflight, self._phase = round_state
            exchange.sent = []
            exchange.arrived = True

    def advance_partial(self, exchange: PartialExchange) -> None:
        """Move a compressed exchange on by one stage: wait for those of its codecs' collectives that have
        a next one (an all-gather after an all-to-all, say) and issue it, so that later stages travel
        during inner steps too. A codec's last collective, and uncompressed packs, are left travelling.
        Every rank calls it at the same point; without such stages it does nothing.
        """
        with self.lock:
            if exchange.arrived or not exchange.staged():
                return
            staged = [sent for sent in exchange.sent if sent.staged]
            # With them, their packs' flags where they travel apart (issued just before the codecs' first
            # collectives, so back by now): the codecs resume knowing the round's contributors.
            packs = {id(sent.pack) for sent in staged}
            flags = [sent for sent in exchange.sent if sent.codec is None and sent.carries_flags
                     and id(sent.pack) in packs]
            travelling = [sent for sent in exchange.sent if not sent.staged and not any(sent is f for f in flags)]
            round_state = (self.inflight, self._phase)
            self.inflight, self._phase = flags + staged, Phase.EXCHANGE
            try:
                self.wait(None)
                self._sum_copies()
                self._resume_codecs()
                exchange.sent = travelling + self.inflight
            finally:
                self.inflight, self._phase = round_state

    def finish_partial(self, exchange: PartialExchange) -> None:
        """Wait for ``exchange`` (:meth:`arrive_partial`) and act on its control flags as a round's end
        does: the checks, the plan fixed once, parameters unfrozen. Every rank calls it at the same point.

        Raises:
            RuntimeError: the ranks are not in step (see :meth:`distopt.planning.control.Totals.check`).
            ValueError: the ranks unfroze different parameters.
        """
        self.arrive_partial(exchange)
        with self.lock:
            if exchange.settled:
                return
            exchange.settled = True
            totals = exchange.totals
            if totals is None:
                return
            totals.check(self.world_size if self.config.flags_from_all else None)
            self._settle(totals)
            if self._on_settled is not None:
                self._on_settled()

    # ------------------------------------------------------------------ shadow rounds (a rank that has joined)

    def shadow_launch(self) -> None:
        """As a rank that has joined: send zeros for the others' next round (the fragment :meth:`set_shadow_fragment`'s chooser names)."""
        with self.lock:
            self.stats = StepStats()
            self.join.joined = True
            self._next_round()
            if self.round_hooks is not None:  # fault tolerance: the shadow round's quorum
                self.round_hooks.enter_round()
            if not self.packs:  # nothing trainable: only the control flags travel, at once
                self.control_round()
                return
            if self.join.probed:  # the last one was the others' probe: their round is still to come
                self.join.probed = False
                fragment = self.join.shadowed
            else:
                fragment = None if self.exchange.shadow_fragment is None else self.exchange.shadow_fragment()
            self.join.shadowed = fragment
            if fragment is None:
                self.flush()
                return
            self._phase = Phase.EXCHANGE  # the others' fragment exchange
            for k in self.exchange.fragment_packs[fragment]:
                self._launch(k)
            self.state = RoundState.FLUSHED

    def shadow_finish(self, final: Optional[Callable[[], None]] = None) -> int:
        """Finish the shadow round (or ``final``, a mode's last round); return how many ranks contributed."""
        if final is not None:
            final()  # takes the lock itself
        with self.lock:
            if self.inflight:
                self.finish_round()
            self.reset_round()
            return self.outcome.contributors

    def shadow_pending(self) -> Optional[Sent]:
        """The first collective of the shadow round in flight not completed yet, or None."""
        return next((sent for sent in self.inflight if not sent.work.is_completed()), None)

    def poll(self) -> bool:
        """Complete what has arrived without waiting (gathered copies, rows); False while more is due."""
        with self.lock:
            return self._arrive(0.0)

    # ------------------------------------------------------------------ probe rounds (the ranks still training)

    def probe(self, fragment: Optional[int] = None) -> Totals:
        """Inside a join block, as a rank still training: learn who trains now, from a round of its own.

        A rank that has joined waits in a shadow round for the others' next round, and a collective of
        the others' own (the drift check's) would meet it there and wait for ever. So before one, every rank
        still training sends this *probe round*: the shape of that shadow round (zeros in every pack of the
        plan, or in ``fragment``'s, through the same collectives and codecs), contributing, with the probe
        flag raised. A rank that has joined shadows it and does nothing else for it (:meth:`_shadowed_probe`);
        the ranks that sent it read from its sums how many ranks contributed, and so whether every rank
        trains on. Every rank still training calls it at the same point; a rank that ran a round of training
        instead fails that round on every rank (:meth:`~distopt.planning.control.Totals.check`).

        It leaves this rank as it was: the packs' buffers (the gradients), the round in progress, the
        compressor's state (put back from a copy), :attr:`stats`, and its place among the rounds. It costs
        one round of the gradients' size (the zeros, in buffers of their own for its duration).

        Args:
            fragment: the streaming fragment whose packs the rounds send now (None: every pack).

        Returns:
            The round's control flags, summed: :attr:`~distopt.planning.control.Totals.training` ranks train.

        Raises:
            RuntimeError: the ranks are not in step (see :meth:`distopt.planning.control.Totals.check`).
            StallError: a rank did not send its part within the stall timeout.
        """
        compressor = self.config.compressor
        with self.lock:
            saved = (self.packs, self.inflight, self._control, self._phase, self._round_step, self.stats)
            before = None if compressor is None else compressor.state_dict()  # a copy (PowerSGD's Q moves)
            self._probing = True
            self._round_step = self.rounds  # the place a joined rank's shadow round takes, and gives back
            self.inflight, self._control, self._phase, self.stats = [], None, Phase.EXCHANGE, StepStats()
            try:
                if self.packs:
                    self.packs = [probe_copy(pack) for pack in self.packs]
                    for k in (range(len(self.packs)) if fragment is None else self.exchange.fragment_packs[fragment]):
                        self._launch(k)
                    self._arrive(None)
                    sent = next(sent for sent in self.inflight if sent.carries_flags)
                    off_wire(sent.pack)
                    flags = sent.pack.flags[-CONTROL_FLAGS:].tolist()
                else:  # nothing trainable: the flags alone, as a joined rank's control round
                    sent_flags = self._control_flags().clone()
                    with stalls.inspected(self.progress, "the probe round of check_drift() (its control flags)"):
                        collectives.all_reduce(sent_flags, op="sum", group=self.channel.group)
                    flags = sent_flags.tolist()
            finally:
                self._probing = False
                self.packs, self.inflight, self._control, self._phase, self._round_step, self.stats = saved
                if before is not None:
                    compressor.load_state_dict(before)
        totals = Totals.read(flags, self.world_size, averaged=self.config.op == dist.ReduceOp.AVG)
        totals.check(self.world_size if self.config.flags_from_all else None)
        return totals


def _make_hook(ref: "weakref.ReferenceType[GradientEngine]", index: int) -> Callable[[Tensor], None]:
    # A weak reference, so a dropped optimizer is collected and its hooks go quiet.
    def hook(param: Tensor) -> None:
        engine = ref()
        if engine is not None and not engine.quiet:
            engine.on_grad_ready(index)

    return hook

_TOUCHED_WHILE_PENDING = (
    "gradients were changed (clipped, unscaled, ...) after backward() returned but before every rank's "
    "gradients had arrived (distopt waited {:g} s for them at the end of backward, then went on); the ranks "
    "would apply different updates. Call opt.synchronize() after backward() and before touching gradients"
)


def _written(pack: Pack) -> Tensor:
    """What the user can change through ``.grad`` while the pack is in flight."""
    return pack.data if pack.direct else pack.buffer
