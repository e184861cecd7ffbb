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
Once a round is back, control flags in every pack tell every rank alike whether
the ranks reduced at different points (an error on every rank) or unfroze
parameters (tracked at once, on every rank together).

The engine knows nothing of steps or optimizers; a mode (:mod:`distopt.modes`)
decides what happens at ``step()``.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from . import collectives
from .packing import LaunchOrder, plan_packs
from .packs import CONTROL_FLAGS, Pack, adopt_current_grads, build_packs, gather, metas
from .private_groups import PrivateGroup

__all__ = ["GradientEngine", "StepStats", "IDLE", "ACTIVE", "DONE", "BACKWARD_PATIENCE"]

#: Seconds the end of backward waits at least for the other ranks' gradients before leaving the
#: round pending (finished by synchronize(), step() or zero_grad()); it grows to 20 times the
#: slowest wait seen, so that slow links do not leave rounds pending. Long enough for a rank that
#: saves a checkpoint or evaluates while the others start the next step.
BACKWARD_PATIENCE = 60.0

# Round states: gradients accumulate locally (IDLE), the reducing backward is
# running (ACTIVE), gradients are averaged and final (DONE).
IDLE, ACTIVE, DONE = range(3)

# Where a rank launched its packs this round. Every pack's tail carries, after one
# presence flag per member, three control flags that every rank reads alike once
# the round is back: "launched during backward", "launched only inside step()"
# and "a parameter frozen when it was tracked is trainable now".
_BACKWARD, _EXPLICIT, _IMPLICIT = range(3)


@dataclass
class StepStats:
    """What the last reduction round did.

    Attributes:
        packs: all-reduces launched.
        packs_at_flush: of those, how many launched only at the end of backward
            (the rest overlapped with backward).
        bytes: bytes put on the wire.
        wait_seconds: time spent blocked waiting for communication.
    """

    packs: int = 0
    packs_at_flush: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0


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
    """

    def __init__(self, *, channel: Optional[PrivateGroup], scale: Optional[float], op: Any,
                 pack_threshold: int, wire_dtype: Optional[torch.dtype], sparse_as_dense: bool,
                 backward_passes_per_step: int, root_rank: int) -> None:
        self.channel = channel
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
        self.launch_order = LaunchOrder([])
        self.planned = False
        self.sync_enabled = True  # False inside no_sync()
        self.lock = threading.Lock()
        self.reset_round()

    # ------------------------------------------------------------------ set-up

    def track(self, params: Sequence[Tensor], names: Sequence[str]) -> None:
        """Reduce ``params`` (already checked across ranks): the trainable ones now, the frozen once trainable."""
        trainable = [(p, n) for p, n in zip(params, names) if p.requires_grad]
        frozen = [(p, n) for p, n in zip(params, names) if not p.requires_grad]
        self.frozen.extend(p for p, _ in frozen)
        self.frozen_names.extend(n for _, n in frozen)
        self._hook([p for p, _ in trainable], [n for _, n in trainable])

    def _hook(self, params: Sequence[Tensor], names: Sequence[str]) -> None:
        ref = weakref.ref(self)
        for index, p in enumerate(params, len(self.params)):
            self.handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref, index)))
        self.params.extend(params)
        self.names.extend(names)
        # Reverse registration order is the usual arrival order; the root's observed order replaces it later.
        self._build_packs(list(reversed(range(len(self.params)))))
        self.planned = False
        self.reset_round()

    def close(self) -> None:
        """Remove every hook and destroy the private group: nothing is reduced any more."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.channel is not None:
            self.channel.destroy()

    def _build_packs(self, order: Sequence[int]) -> None:
        packs = build_packs(self.params, self.names, order, self.pack_threshold, self.wire_dtype)
        if self.packs:  # a re-plan: gradients move from the old buffers to the new ones
            adopt_current_grads(packs)
        self.packs = packs
        self.pack_of = [0] * len(self.params)
        for k, pack in enumerate(packs):
            for i in pack.spec.members:
                self.pack_of[i] = k
        self.launch_order = LaunchOrder([len(pack.spec.members) for pack in packs])

    # ------------------------------------------------------------------ the round

    def reset_round(self) -> None:
        """Start a new round: nothing fired, nothing in flight."""
        self.state = IDLE
        self._passes = 0
        self._pass_open = False
        self._pass_counts = False
        self._pass_reduces = False
        self._inflight: List[Tuple[Any, Pack]] = []
        self._fired = bytearray(len(self.params))
        self._arrivals: List[int] = []
        self._phase = _BACKWARD
        self._pending_versions: Optional[List[int]] = None
        self._patience_used = 0.0
        self._control: Optional[Tensor] = None  # this rank's control flags, set at its first launch
        self.launch_order.reset()
        for pack in self.packs:
            pack.absent.clear()

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
                self.stats = StepStats()
                self._phase = _EXPLICIT if explicit else _IMPLICIT
            if not self.packs:
                self._adopt_unfrozen_without_packs()
                return
            self._flush()
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
                self._arrivals.append(index)
            for ready in self.launch_order.ready(self.pack_of[index]):
                self._launch(self.packs[ready])

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
        self._pass_counts = self.sync_enabled  # no_sync passes do not count
        self._pass_reduces = self._pass_counts and self._passes == self.backward_passes_per_step - 1
        if self._pass_reduces:
            self.state = ACTIVE
            self.stats = StepStats()
        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        with self.lock:
            self._pass_open = False
            self._passes += self._pass_counts
            if self._pass_reduces:
                self._flush()
                # A rank whose backward reached no parameter sends its packs only in step(); waiting for
                # them here without bound would deadlock with a collective it runs before step().
                self.finish_round(patience=max(BACKWARD_PATIENCE, 20 * self._slowest_wait))

    def _launch(self, pack: Pack) -> None:
        gather(pack, self.scale, self.sparse_as_dense)
        if self._control is None:
            unfrozen = any(p.requires_grad for p in self.frozen)
            self._control = torch.tensor(
                [float(self._phase == _BACKWARD), float(self._phase == _IMPLICIT), float(unfrozen)]
            )
        pack.flags.fill_(1)
        for j in pack.absent:
            pack.flags[j] = 0
        pack.flags[-CONTROL_FLAGS:].copy_(self._control)
        buffer = pack.buffer
        if pack.wire is not None:
            pack.wire.copy_(buffer)
            buffer = pack.wire
        with torch.profiler.record_function("distopt.all_reduce"):
            work = dist.all_reduce(buffer, op=self.op, group=self.channel.group, async_op=True)
        self._inflight.append((work, pack))
        self.stats.packs += 1
        self.stats.bytes += buffer.numel() * buffer.element_size()

    def _flush(self) -> None:
        """Launch every pack not launched yet, sending zeros for members without a gradient."""
        launched_before = self.launch_order.launched
        for k in self.launch_order.flush():
            self._launch(self.packs[k])
        self.stats.packs_at_flush += self.launch_order.launched - launched_before

    def wait(self, patience: Optional[float] = None) -> bool:
        """Block until every launched all-reduce is done (their buffers may be written until then).

        Args:
            patience: give up after this many seconds. CUDA packs (NCCL) ignore it: their plain
                wait only orders the streams, while a wait with a timeout would block the host.

        Returns:
            False if it gave up: the all-reduces go on, and a later wait finishes them.
        """
        if not self._inflight:
            return True
        start = time.perf_counter()
        try:
            with torch.profiler.record_function("distopt.wait"):
                for work, pack in self._inflight:
                    if patience is None or pack.buffer.is_cuda:
                        work.wait()
                        continue
                    left = max(patience - (time.perf_counter() - start), 0.001)
                    try:
                        work.wait(timeout=timedelta(seconds=left))
                    except RuntimeError as exc:
                        if "timed out" not in str(exc).lower():
                            raise
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
            RuntimeError: some ranks reduced during backward and others only inside step(),
                or gradients were changed while the round was pending.
            ValueError: the ranks unfroze different parameters.
        """
        start = time.perf_counter()
        if not self.wait(patience):
            # Remember the buffers' versions: changing a gradient before it is averaged is an error.
            self._pending_versions = [pack.buffer._version for _, pack in self._inflight]
            self._patience_used = patience
            return
        if patience is not None:
            self._slowest_wait = max(self._slowest_wait, time.perf_counter() - start)
        touched = self._pending_versions is not None and any(
            pack.buffer._version != version for (_, pack), version in zip(self._inflight, self._pending_versions)
        )
        self._pending_versions = None
        control = None
        for _, pack in self._inflight:
            if pack.wire is not None:
                pack.buffer.copy_(pack.wire)
            if control is None:
                control = pack.flags[-CONTROL_FLAGS:].tolist()
            if pack.absent:
                present = pack.flags.tolist()
                for j in pack.absent:
                    # Averaged with zeros where some rank had a gradient; None where none had.
                    index = pack.spec.members[j]
                    self.params[index].grad = pack.views[j] if present[j] else None
                pack.absent.clear()
        self._inflight = []
        self.state = DONE
        self._passes = self.backward_passes_per_step
        if control is None:
            return
        during_backward, inside_step, unfrozen = control
        if during_backward and inside_step:
            raise RuntimeError(_MIXED_ROUND)
        if touched:
            raise RuntimeError(_TOUCHED_WHILE_PENDING.format(self._patience_used))
        if unfrozen:
            self._adopt_unfrozen()
        elif not self.planned:
            self._fix_plan()

    def _adopt_unfrozen(self) -> None:
        """Track the parameters every rank unfroze, and reduce this round again with them."""
        mine = [n for p, n in zip(self.frozen, self.frozen_names) if p.requires_grad]
        everyone = collectives.all_gather_object(mine, group=self.channel.group)
        if any(theirs != everyone[0] for theirs in everyone):
            detail = "; ".join(f"rank {r}: {theirs}" for r, theirs in enumerate(everyone))
            raise ValueError(
                f"different ranks made different parameters trainable ({detail}); set requires_grad alike on "
                "every rank, at the same step"
            )
        params = [p for p in self.frozen if p.requires_grad]
        self.frozen_names = [n for p, n in zip(self.frozen, self.frozen_names) if not p.requires_grad]
        self.frozen = [p for p in self.frozen if not p.requires_grad]
        self._hook(params, mine)  # re-plans; the gradients move into the new packs
        # The old parameters' gradients are averaged already; averaging them again changes
        # nothing but rounding, and keeps one plan for every parameter.
        self.state = ACTIVE
        self._flush()
        self.finish_round()

    def _adopt_unfrozen_without_packs(self) -> None:
        # With nothing trainable at construction there are no packs to carry the flag.
        flag = torch.tensor([float(any(p.requires_grad for p in self.frozen))])
        collectives.all_reduce(flag, op="max", group=self.channel.group)
        self.state = DONE
        if flag.item():
            self._adopt_unfrozen()

    def _fix_plan(self) -> None:
        """Adopt the root's observed gradient order as the plan on every rank.

        The message starts with how many arrivals the root saw: a round without
        any (gradients set by hand) leaves the plan open for the next round.
        """
        seen = set(self._arrivals)
        order = self._arrivals + [i for i in reversed(range(len(self.params))) if i not in seen]
        message = torch.tensor([len(self._arrivals)] + order, dtype=torch.int64)
        collectives.broadcast(message, src=self.root_rank, group=self.channel.group)
        observed, *root_order = message.tolist()
        if not observed:
            return
        # Only which packs exist, and their order, matter to matching; keeping the buffers when
        # those are unchanged also spares a second set of buffers at the peak.
        plan = plan_packs(root_order, metas(self.params), self.pack_threshold)
        if [set(spec.members) for spec in plan] != [set(pack.spec.members) for pack in self.packs]:
            self._build_packs(root_order)
        self.planned = True


_TOUCHED_WHILE_PENDING = (
    "gradients were changed (clipped, unscaled, ...) after backward() returned but before every rank's "
    "gradients had arrived (distopt waited {:g} s for them at the end of backward, then went on); the ranks "
    "would apply different updates. Call opt.synchronize() after backward() and before touching gradients"
)
_MIXED_ROUND = (
    "ranks averaged their gradients at different points: some during backward(), others only inside step(), "
    "because their backward passes gave no gradient to any parameter this optimizer holds (a skipped batch "
    "with a constant loss, a detached loss) or were fewer than backward_passes_per_step. Code between "
    "backward() and step() (clipping, GradScaler, logging) would see different gradients on different ranks "
    "and the ranks would drift apart. Call opt.synchronize() right after backward() on every rank (it "
    "averages at once everywhere), or keep every rank's loss connected to the parameters "
    "(e.g. loss = model(x).sum() * 0.0)"
)


def _make_hook(ref: "weakref.ReferenceType[GradientEngine]", index: int) -> Callable[[Tensor], None]:
    # A weak reference, so a dropped optimizer is collected and its hooks go quiet.
    def hook(param: Tensor) -> None:
        engine = ref()
        if engine is not None:
            engine.on_grad_ready(index)

    return hook
