"""The reduction engine under :class:`distopt.DistributedOptimizer`: hooks, packs and the round.

This is the hot path. A post-accumulate-grad hook on every tracked parameter
marks its gradient ready; the gradient moves into its pack's persistent flat
buffer (scaled in the same pass) and ``.grad`` becomes a view of its slice.
Packs launch one asynchronous all-reduce each, strictly in the order of a plan
every rank holds identically (:class:`distopt.packing.LaunchOrder`). At the end
of the reducing backward pass (an autograd engine callback) the rest is flushed
and everything is awaited in :meth:`GradientEngine.finish_round`, the one place
that waits.

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
have joined (:mod:`distopt.joining`): a rank that has joined runs
:meth:`GradientEngine.shadow_round`, sending zeros, and the contributors' mean
is rescaled to count only them. Waits are watched by the stall inspector
(:mod:`distopt.stalls`).

The engine knows nothing of steps or optimizers; a mode (:mod:`distopt.modes`)
decides what happens at ``step()``. A mode that keeps gradients local (local SGD,
:mod:`distopt.modes.local_sgd`) sets :attr:`GradientEngine.local`, so backward
never reduces, and sends its own values through the same packs, plan and flags
(:mod:`distopt.exchange`).
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from . import collectives, replanning, stalls, waiting
from .control import CONTROL_FLAGS, Control, Totals
from .packing import LaunchOrder
from .packs import Pack, adopt_current_grads, build_packs, gather, gather_early, gather_nothing, release, scratch
from .private_groups import PrivateGroup
from .stalls import Progress
from .stats import StepStats

__all__ = ["GradientEngine", "Sent", "IDLE", "ACTIVE", "DONE", "PHASE_EXCHANGE", "BACKWARD_PATIENCE"]

#: Seconds the end of backward waits at least for the other ranks' gradients before leaving the
#: round pending (finished by synchronize(), step() or zero_grad()); it grows to 20 times the
#: slowest wait seen, so that slow links do not leave rounds pending. Long enough for a rank that
#: saves a checkpoint or evaluates while the others start the next step.
BACKWARD_PATIENCE = 60.0

# Round states: gradients accumulate locally (IDLE), the reducing backward is
# running (ACTIVE), gradients are averaged and final (DONE).
IDLE, ACTIVE, DONE = range(3)

# Where a rank launched its packs this round (see :mod:`distopt.control`); an exchange
# (:mod:`distopt.exchange`) is no gradient round, so it raises neither the "during backward"
# nor the "inside step" flag.
_BACKWARD, _EXPLICIT, _IMPLICIT, PHASE_EXCHANGE = range(4)


class Sent(NamedTuple):
    """One all-reduce in flight."""

    work: Any
    pack: Pack
    index: int  # the pack's place in the plan
    seq: int  # the collective's number on the channel, for the stall inspector
    carries_flags: bool  # False for a direct pack's gradient, whose flags travel apart


class GradientEngine:
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
        self.pack_threshold = pack_threshold
        self.wire_dtype = wire_dtype
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self.root_rank = root_rank
        self.stats = StepStats()
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
        self._phase = _BACKWARD
        self._pending_versions: Optional[List[int]] = None
        self._patience_used = 0.0
        self._control: Optional[Tensor] = None  # this rank's control flags, set at its first launch
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

    def synchronize(self, explicit: bool) -> None:
        """Reduce whatever is not reduced yet this round and wait for it; a no-op once DONE.

        Args:
            explicit: the user asked for it (``synchronize()``), rather than ``step()``
                reducing what backward did not.
        """
        if self.state == DONE:
            return
        with self.lock:
            if self.state == IDLE:  # else the round is pending: launched in backward, still in flight
                self.open_round(_EXPLICIT if explicit else _IMPLICIT)
            if not self.packs:
                self.control_round()
                return
            self.flush()
            self.finish_round()

    def on_grad_ready(self, index: int) -> None:
        with self.lock:
            if not self._pass_open:
                self._open_pass()
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

    def _open_pass(self) -> None:
        """First hook of a backward pass: decide whether it reduces, and hook its end."""
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
                during_backward=not self.joined and self._phase == _BACKWARD,
                inside_step=not self.joined and self._phase == _IMPLICIT,
                unfrozen=not self.joined and any(p.requires_grad for p in self.frozen),
                contributing=not self.joined,
                in_join=self.in_join,
                divide_by_world=self.divide_by_world,
            ).tensor()
        return self._control

    def _launch(self, index: int) -> None:
        pack = self.packs[index]
        if self.joined:
            gather_nothing(pack)
        else:
            if self.exchange_fill is not None:
                scratch(pack)
                self.exchange_fill(pack)
            else:
                gather(pack, self.scale, self.sparse_as_dense)
            pack.flags.fill_(1)
            for j in pack.absent:
                pack.flags[j] = 0
        pack.flags[-CONTROL_FLAGS:].copy_(self._control_flags())
        if pack.wire is not None:
            pack.wire.copy_(pack.buffer)
        with _labelled("distopt.all_reduce"):
            if pack.direct:
                self._send(pack.data, pack, index, False)
            self._send(pack.target if not pack.direct else pack.buffer, pack, index, True)
        self.stats.packs += 1

    def _send(self, tensor: Tensor, pack: Pack, index: int, carries_flags: bool) -> None:
        # The group's own method, as DDP's reducer calls it: dist.all_reduce's Python layer costs
        # ~20 µs a call and does nothing a private group needs.
        options = dist.AllreduceOptions()
        options.reduceOp = self.op
        options.asyncOp = True
        work = self.channel.group.allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor], options)
        seq = self.progress.issue() if self.progress is not None else 0
        self.inflight.append(Sent(work, pack, index, seq, carries_flags))
        self.stats.all_reduces += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()

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
            kind = "parameter exchange (local SGD)" if self._phase == PHASE_EXCHANGE else "gradient all-reduce"
            deadline = None if patience is None else start + patience
            with _labelled("distopt.wait"):
                for sent in self.inflight:
                    what = f"pack {sent.index + 1}/{len(self.packs)} of the {kind}"
                    if not waiting.wait_for(sent.work, sent.pack.buffer.is_cuda, self.progress, sent.seq, what,
                                            deadline):
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
            RuntimeError: the ranks are not in step (see :meth:`distopt.control.Totals.check`),
                or gradients were changed while the round was pending.
            ValueError: the ranks unfroze different parameters.
        """
        start = time.perf_counter()
        if not self.wait(patience):
            # Remember the buffers' versions: changing a gradient before it is averaged is an error.
            self._pending_versions = [_written(sent.pack)._version for sent in self.inflight]
            self._patience_used = patience
            return
        if patience is not None:
            self._slowest_wait = max(self._slowest_wait, time.perf_counter() - start)
        touched = self._pending_versions is not None and any(
            _written(sent.pack)._version != version for sent, version in zip(self.inflight, self._pending_versions)
        )
        self._pending_versions = None
        totals = None
        for sent in self.inflight:
            if not sent.carries_flags:
                continue
            pack = sent.pack
            if pack.wire is not None:
                pack.buffer.copy_(pack.wire)
            if totals is None:
                totals = self._totals(pack.flags[-CONTROL_FLAGS:].tolist())
            factor = totals.rescale(self.world_size, self.mean)
            if factor != 1.0:
                pack.data.mul_(factor)
            if pack.absent:
                present = pack.flags.tolist()
                for j in pack.absent:
                    # Averaged with zeros where some rank had a gradient; None where none had.
                    index = pack.spec.members[j]
                    self.params[index].grad = pack.views[j] if present[j] else None
                pack.absent.clear()
        self.inflight = []
        self.state = DONE
        self._passes = self.backward_passes_per_step
        if self.progress is not None:
            self.progress.phase = "after backward, before step()"
        if totals is None:
            return
        totals.check(self.world_size)
        if touched:
            raise RuntimeError(_TOUCHED_WHILE_PENDING.format(self._patience_used))
        self._settle(totals)

    def _totals(self, flags: List[float]) -> Totals:
        totals = Totals.read(flags, self.world_size, averaged=self.op == dist.ReduceOp.AVG)
        if totals.contributing:
            self.contributors = totals.contributing
            self.contributed_last = not self.joined
        else:
            self.contributors = 0
        return totals

    def _settle(self, totals: Totals) -> None:
        if totals.unfrozen:
            replanning.adopt_unfrozen(self)
        elif not self.planned:
            replanning.fix_plan(self)

    def control_round(self) -> None:
        """A round without packs (nothing trainable yet): only the control flags travel."""
        flags = self._control_flags().clone()
        with stalls.inspected(self.progress, "the control flags (no trainable parameter yet)"):
            collectives.all_reduce(flags, op="sum", group=self.channel.group)
        self.state = DONE
        totals = self._totals(flags.tolist())
        totals.check(self.world_size)
        if totals.unfrozen:
            replanning.adopt_unfrozen(self)


_TOUCHED_WHILE_PENDING = (
    "gradients were changed (clipped, unscaled, ...) after backward() returned but before every rank's "
    "gradients had arrived (distopt waited {:g} s for them at the end of backward, then went on); the ranks "
    "would apply different updates. Call opt.synchronize() after backward() and before touching gradients"
)


def _labelled(name: str) -> Any:
    """A profiler label, only while a profiler runs: otherwise it costs 10-100 µs for nothing."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def _written(pack: Pack) -> Tensor:
    """What the user can change through ``.grad`` while the pack is in flight."""
    return pack.data if pack.direct else pack.buffer


def _make_hook(ref: "weakref.ReferenceType[GradientEngine]", index: int) -> Callable[[Tensor], None]:
    # A weak reference, so a dropped optimizer is collected and its hooks go quiet.
    def hook(param: Tensor) -> None:
        engine = ref()
        if engine is not None:
            engine.on_grad_ready(index)

    return hook
