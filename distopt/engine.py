"""The reduction engine under :class:`distopt.DistributedOptimizer`: hooks, packs and the round.

This is the hot path. A post-accumulate-grad hook on every tracked parameter
marks its gradient ready; the gradient moves into its pack's persistent flat
buffer (scaled in the same pass) and ``.grad`` becomes a view of its slice.
Packs launch one asynchronous all-reduce each, strictly in the order of a plan
every rank holds identically (:class:`distopt.packing.LaunchOrder`). At the end
of the reducing backward pass (an autograd engine callback) the rest is flushed
and everything is awaited in ``finish_round``, the one place that waits
(:mod:`distopt.round_end`, a mixin of the engine). A pack of one large CPU
gradient that is mostly zero rows (an embedding table's) gathers its non-zero rows
instead of all-reducing the whole (:mod:`distopt.sparse_rows`); a small CPU pack
travels once and is summed locally, in rank order, instead of passing the ring twice
(:func:`distopt.rounds.sums_by_gather`). Both gather as one broadcast from each rank
(:func:`distopt.rounds.broadcast_each`).

A *round* is what happens between two ``step()``/``zero_grad()`` calls: backward
passes accumulate locally (``IDLE``), the reducing pass runs (``ACTIVE``), and
once every pack is back the gradients are averaged and final (``DONE``).

The wait at the end of backward is bounded (:data:`BACKWARD_PATIENCE`): a rank
whose backward reached no parameter sends its packs only in ``step()``, and an
unbounded wait would deadlock with any collective that rank runs first. The
round then stays pending until ``synchronize()``, ``step()`` or ``zero_grad()``.
Once a round is back, the control flags in every pack (:mod:`distopt.control`)
tell every rank alike whether the ranks reduced at different points (an error on
every rank), unfroze parameters (tracked at once, on every rank together), or
have joined (:mod:`distopt.joining`): a rank that has joined runs shadow
rounds, sending zeros, and the contributors' mean is rescaled to count only them. Waits are watched by the stall inspector
(:mod:`distopt.stalls`).

The engine knows nothing of steps or optimizers; a mode (:mod:`distopt.modes`)
decides what happens at ``step()``. A mode that keeps gradients local (local SGD,
:mod:`distopt.modes.local_sgd`) sets :attr:`GradientEngine.local`, so backward
never reduces, and sends its own values through the same packs, plan and flags
(:mod:`distopt.exchange`).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from . import sparse_rows, stalls
from .control import CONTROL_FLAGS, Control
from .packing import LaunchOrder
from .packs import (Pack, adopt_current_grads, build_packs, gather, gather_early, gather_nothing, release, scratch,
                    sums)
from .private_groups import PrivateGroup
from .round_end import RoundEnd
from .rounds import (ACTIVE, DONE, IDLE, PHASE_BACKWARD, PHASE_EXCHANGE, PHASE_EXPLICIT, PHASE_IMPLICIT,
                     GATHER_SUM_MAX_BYTES, Sent,
                     broadcast_each, gather_buffer, gather_by_broadcasts, labelled, plan_gathers, sums_by_gather)
from .stalls import Progress
from .stats import StepStats

__all__ = ["GradientEngine", "BACKWARD_PATIENCE"]

#: Seconds the end of backward waits at least for the other ranks' gradients before leaving the
#: round pending (finished by synchronize(), step() or zero_grad()); it grows to 20 times the
#: slowest wait seen, so that slow links do not leave rounds pending. Long enough for a rank that
#: saves a checkpoint or evaluates while the others start the next step.
BACKWARD_PATIENCE = 60.0


class GradientEngine(RoundEnd):
    """Averages the gradients of the parameters it tracks, during backward.

    Args:
        channel: the private group to reduce over.
        scale: factor applied while copying into a pack (the mean's 1/world), or None.
        op: the all-reduce op (``SUM``, or ``AVG`` where the backend averages natively).
        pack_threshold: bytes at which a pack closes.
        wire_dtype: 16-bit dtype float packs travel as, or None.
        sparse_as_dense: densify sparse gradients instead of raising.
        backward_passes_per_step: passes accumulated before the reducing one.
        root_rank: the rank whose observed gradient order becomes the plan.
        world_size: ranks in the channel.
        mean: gradients are averaged (not summed) over the ranks.
        progress: where this rank is, for the stall inspector (None in a single process).
    """

    def __init__(self, *, channel: Optional[PrivateGroup], scale: Optional[float], op: Any,
                 pack_threshold: int, wire_dtype: Optional[torch.dtype], sparse_as_dense: bool,
                 backward_passes_per_step: int, root_rank: int, world_size: int = 1, mean: bool = True,
                 progress: Optional[Progress] = None) -> None:
        self.channel = channel
        self.world_size = world_size
        self.mean = mean
        self.progress = progress
        # Join (see distopt.joining): whether this rank is in a join block, has joined (sends zeros),
        # and how the last round with contributors went.
        self.in_join = False
        self.divide_by_world = False
        self.joined = False
        self.contributors = world_size  # ranks that contributed to the last round
        self.contributed_last = True  # this rank contributed to the last round that had contributors
        self.scale = scale
        self.op = op
        self.rows_allowed = True  # large gradients of mostly zero rows may travel as rows
        # Bytes a rank may receive for a small sum to travel as a gather (rounds.sums_by_gather).
        self.gather_sum_limit = GATHER_SUM_MAX_BYTES
        self.pack_threshold = pack_threshold
        self.wire_dtype = wire_dtype
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self.root_rank = root_rank
        self.stats = StepStats()
        self.steps = 0  # the owner's steps taken; its parity travels in the control flags
        self._slowest_wait = 0.0  # seconds, of the waits at the end of backward that finished
        self.params: List[Tensor] = []
        self.names: List[str] = []
        # Parameters held but frozen when they were tracked; they join once trainable.
        self.frozen: List[Tensor] = []
        self.frozen_names: List[str] = []
        self.handles: List[Any] = []  # hook handles, removed by close()
        self.packs: List[Pack] = []
        self.pack_of: List[int] = []  # parameter index -> pack index
        self.slot_of: List[int] = []  # parameter index -> its place in its pack
        self.launch_order = LaunchOrder([])
        self.planned = False
        self.sync_enabled = True  # False inside no_sync()
        # True while a local-SGD mode keeps gradients local: backward passes never reduce.
        self.local = False
        # While an exchange runs: writes what to send into a pack, instead of its gradients.
        self.exchange_fill: Optional[Callable[[Pack], None]] = None
        self.lock = threading.Lock()
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
                self.handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref, index)))
        self.params.extend(params)
        self.names.extend(names)
        # Reverse registration order is the usual arrival order; the root's observed order replaces it later.
        self.build_packs(list(reversed(range(len(self.params)))))
        self.planned = False
        self.reset_round()

    def close(self) -> None:
        """Remove every hook and destroy the private group: nothing is reduced any more."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.progress is not None:
            stalls.retire(self.progress)
        if self.channel is not None:
            self.channel.destroy()

    def build_packs(self, order: Sequence[int]) -> None:
        packs = build_packs(self.params, self.names, order, self.pack_threshold, self.wire_dtype)
        for pack in packs:
            if pack.direct and self.rows_allowed and self.channel is not None:
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

    # ------------------------------------------------------------------ the round

    def reset_round(self) -> None:
        """Start a new round: nothing fired, nothing in flight."""
        self.state = IDLE
        self._passes = 0
        self._pass_open = False
        self._pass_counts = False
        self._pass_reduces = False
        self.inflight: List[Sent] = []
        self._fired = bytearray(len(self.params))
        self.arrivals: List[int] = []
        self._phase = PHASE_BACKWARD
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

    def forbid_rows(self) -> None:
        """Never send a gradient as its rows (a mode that exchanges parameters).

        A rank that has joined sends zeros in the shape of whatever the others send, and
        cannot tell an exchange (always dense) from a gradient round (rows, where they pay).
        """
        self.rows_allowed = False
        for pack in self.packs:
            pack.rows = None

    def synchronize(self, explicit: bool) -> None:
        """Reduce whatever is not reduced yet this round and wait for it; a no-op once DONE.

        Args:
            explicit: the user asked for it (``synchronize()``), rather than ``step()``
                reducing what backward did not.
        """
        if self.state == DONE or (self.state == IDLE and self._unchanged_since_step()):
            return
        with self.lock:
            if self.state == IDLE:  # else the round is pending: launched in backward, still in flight
                self.open_round(PHASE_EXPLICIT if explicit else PHASE_IMPLICIT)
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
                gather_early(pack, self.slot_of[index], self.scale, self.sparse_as_dense)
            for ready in self.launch_order.ready(self.pack_of[index]):
                self._launch(ready)

    def _open_pass(self, index: int) -> None:
        """First hook of a backward pass: decide whether it reduces, and hook its end."""
        if self.state == DONE and self._cleared_since_round(index):
            self.reset_round()  # e.g. model.zero_grad() after a step GradScaler skipped
        self._consumed = None
        if self._passes >= self.backward_passes_per_step or self.state == DONE:
            raise RuntimeError(
                f"backward() ran again after the gradients were averaged (backward_passes_per_step="
                f"{self.backward_passes_per_step}): call step() or zero_grad() before the next backward(), "
                f"or raise backward_passes_per_step to accumulate more passes (a reentrant "
                f"torch.utils.checkpoint also runs nested backward passes: use use_reentrant=False)"
            )
        self._pass_open = True
        self._pass_counts = self.sync_enabled and not self.local  # no_sync and local passes do not count
        self._pass_reduces = self._pass_counts and self._passes == self.backward_passes_per_step - 1
        if self._pass_reduces:
            self.state = ACTIVE
            self.stats = StepStats()
        if self.progress is not None:
            self.progress.phase = "in backward" if self._pass_reduces else "in backward (accumulating locally)"
        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        with self.lock:
            self._pass_open = False
            self._passes += self._pass_counts
            if self._pass_reduces:
                self.flush()
                # A rank whose backward reached no parameter sends its packs only in step(); waiting for
                # them here without bound would deadlock with a collective it runs before step().
                self.finish_round(patience=max(BACKWARD_PATIENCE, 20 * self._slowest_wait))

    def _control_flags(self) -> Tensor:
        if self._control is None:
            self._control = Control(
                during_backward=not self.joined and self._phase == PHASE_BACKWARD,
                inside_step=not self.joined and self._phase == PHASE_IMPLICIT,
                unfrozen=not self.joined and any(p.requires_grad or p.grad is not None for p in self.frozen),
                contributing=not self.joined,
                in_join=self.in_join,
                divide_by_world=self.divide_by_world,
                # An exchange (local SGD) meets a rank leaving a join block at its own step count.
                counts_steps=not self.joined and self._phase != PHASE_EXCHANGE,
                odd_steps=not self.joined and self._phase != PHASE_EXCHANGE and self.steps % 2 == 1,
            ).tensor()
        return self._control

    def _launch(self, index: int) -> None:
        pack = self.packs[index]
        # Exchanged values (local SGD) are not sparse: only gradients travel as rows.
        rows = pack.rows if pack.rows is not None and pack.rows.cap and self.exchange_fill is None else None
        if rows is None and pack.rows is not None and self.exchange_fill is None:
            sparse_rows.dense_round(pack.rows)  # sent densely this round; rows again once the wait is over
        if self.joined:
            gather_nothing(pack)
        else:
            if self.exchange_fill is not None:
                scratch(pack)
                self.exchange_fill(pack)
            else:  # rows are scaled as they are picked, not the whole gradient
                gather(pack, self.scale if rows is None else None, self.sparse_as_dense)
            pack.flags.fill_(1)
            for j in pack.absent:
                pack.flags[j] = 0
        pack.flags[-CONTROL_FLAGS:].copy_(self._control_flags())
        if pack.wire is not None:
            pack.wire.copy_(pack.buffer)
        with labelled("distopt.all_reduce"):
            if rows is not None:
                self._gather_rows(rows, pack, index)
                self._send(pack.flags, pack, index, carries_flags=True)
            elif pack.direct:
                self._send(pack.data, pack, index, carries_flags=False)
                self._send(pack.flags, pack, index, carries_flags=True)
            else:
                self._send(pack.buffer if pack.wire is None else pack.wire, pack, index, carries_flags=True)
        self.stats.packs += 1

    def _send(self, tensor: Tensor, pack: Pack, index: int, carries_flags: bool) -> None:
        # The group's own methods, as DDP's reducer calls them: dist.all_reduce's Python layer costs
        # ~20 µs a call and does nothing a private group needs.
        flat = torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor
        nbytes = flat.numel() * flat.element_size()
        copies = None
        if (self.op == dist.ReduceOp.SUM and nbytes in pack.gathers
                and sums_by_gather(nbytes, self.world_size, flat.device, self.gather_sum_limit)):
            copies = gather_buffer(pack, flat, self.world_size)
            work = gather_by_broadcasts(self.channel.group, copies, flat, self.world_size)
        else:
            options = dist.AllreduceOptions()
            options.reduceOp = self.op
            options.asyncOp = True
            work = self.channel.group.allreduce([flat], options)
        seq = self.progress.issue() if self.progress is not None else 0
        self.inflight.append(Sent(work, pack, index, seq, carries_flags, copies=copies,
                                  into=None if copies is None else flat))
        self.stats.all_reduces += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()

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
        if self.scale is not None or not self.mean:
            return self.scale
        return 1.0 / self.world_size  # the backend averages dense all-reduces (AVG); gathers do not

    def reduce_again(self) -> None:
        """Send every pack once more and wait (after a re-plan, inside a finished round)."""
        self.state = ACTIVE
        self.flush()
        self.finish_round()

    def flush(self) -> None:
        """Launch every pack not launched yet, sending zeros for members without a gradient."""
        launched_before = self.launch_order.launched
        for k in self.launch_order.flush():
            self._launch(k)
        self.stats.packs_at_flush += self.launch_order.launched - launched_before


def _make_hook(ref: "weakref.ReferenceType[GradientEngine]", index: int) -> Callable[[Tensor], None]:
    # A weak reference, so a dropped optimizer is collected and its hooks go quiet.
    def hook(param: Tensor) -> None:
        engine = ref()
        if engine is not None:
            engine.on_grad_ready(index)

    return hook
