"""The end of a reduction round: the one place that waits, then what every rank reads back.

:meth:`RoundEnd.finish_round` waits for every all-reduce in flight (through
:func:`distopt.waiting.wait_for`), rescales the contributors' mean, settles which
parameters end up with a gradient, checks the control flags (:mod:`distopt.control`)
and changes the plan where they say so (:mod:`distopt.replanning`). Between rounds
it tells what a new call brings: after a step, a ``synchronize()`` or ``step()``
with no gradient changed sends nothing; a backward pass after gradients were
cleared behind the wrapper's back (``model.zero_grad()``) starts a new round. A
mixin of :class:`distopt.engine.GradientEngine`, which launches what it waits for.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives, replanning, sparse_rows, stalls, waiting
from .control import CONTROL_FLAGS, Totals
from .packs import Pack
from .rounds import DONE, PHASE_EXCHANGE, labelled, sum_copies

if TYPE_CHECKING:
    from .rounds import Sent
    from .stalls import Progress
    from .stats import StepStats

__all__ = ["RoundEnd"]


class RoundEnd:
    """Waiting for a round and settling it; the state it reads is the engine's."""

    inflight: List["Sent"]
    packs: List[Pack]
    params: List[Tensor]
    progress: Optional["Progress"]
    stats: "StepStats"
    channel: Any
    world_size: int
    mean: bool
    op: Any
    scale: Optional[float]
    joined: bool
    planned: bool
    state: int
    contributors: int
    contributed_last: bool
    backward_passes_per_step: int
    _phase: int
    _passes: int
    _slowest_wait: float
    _pending_versions: Optional[List[int]]
    _pending_grads: Optional[List[Optional[Tensor]]]
    _touched: bool
    _patience_used: Optional[float]
    frozen: List[Tensor]
    _consumed: Optional[Any]

    def _control_flags(self) -> Tensor:
        raise NotImplementedError

    def reset_round(self) -> None:
        raise NotImplementedError

    def _send(self, tensor: Tensor, pack: Pack, index: int, carries_flags: bool) -> None:
        raise NotImplementedError

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
            with labelled("distopt.wait"):
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
        if not self._arrive(patience):
            return
        if patience is not None:
            self._slowest_wait = max(self._slowest_wait, time.perf_counter() - start)
        touched, self._touched = self._touched, False
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
            for k, sent in list(enumerate(self.inflight)):
                if sent.copies is not None:
                    sum_copies(sent.copies, sent.into, self.channel.group.rank(), self.world_size)
                    self.inflight[k] = sent._replace(copies=None, into=None)
                elif sent.gathered:
                    self.inflight[k] = sent._replace(gathered=False)
                    if not sparse_rows.settle(sent.pack.rows, sent.pack.data):
                        # Some rank had more rows than the gather held: the gradient (this rank's
                        # own, unscaled) is all-reduced instead, watched and bounded like the rest.
                        if self.scale is not None:
                            sent.pack.data.mul_(self.scale)
                        self._send(sent.pack.data, sent.pack, sent.index, carries_flags=False)
                        overflowed = True
            if not overflowed:
                return True

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

    # ------------------------------------------------------------------ between rounds

    def after_step(self) -> None:
        """The inner optimizer stepped: a new round starts, with nothing new to send until a gradient changes."""
        done = self.state == DONE
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


def _written(pack: Pack) -> Tensor:
    """What the user can change through ``.grad`` while the pack is in flight."""
    return pack.data if pack.direct else pack.buffer
