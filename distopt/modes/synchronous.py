"""Synchronous data parallelism: every step applies gradients averaged over all ranks."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor

from .. import collectives, stalls
from .base import Mode

if TYPE_CHECKING:
    from ..optimizer import DistributedOptimizer

__all__ = ["SynchronousMode"]


class SynchronousMode(Mode):
    """Average every gradient during backward, then run the inner optimizer.

    With a ``closure`` (e.g. LBFGS), every call of it is a fresh forward and
    backward, and is followed by a reduction of the gradients it computed and of
    the loss it returned: LBFGS's line search and stopping tests read the loss,
    so every rank must read the same one or the ranks take different steps and
    call the closure a different number of times.
    """

    reduces_in_backward = True

    def step(self, owner: "DistributedOptimizer", closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            owner._reduce_for_step()
            return owner.optimizer.step()
        return owner.optimizer.step(_synchronizing(owner, closure))


def _synchronizing(owner: "DistributedOptimizer", closure: Callable[[], Any]) -> Callable[[], Any]:
    def reduced_closure() -> Any:
        owner._engine.reset_round()  # each closure call is a fresh forward and backward
        with torch.enable_grad():
            loss = closure()
        owner.synchronize()  # at once, before the inner optimizer reads the gradients
        return _reduced_loss(owner, loss)

    return reduced_closure


def _reduced_loss(owner: "DistributedOptimizer", loss: Any) -> Any:
    """The ranks' losses reduced like their gradients (the mean, or the sum), the same on every rank.

    A loss of another type (None, a tuple) is returned as it is: every rank then
    gets its own, as the inner optimizer would have.
    """
    if owner.world_size == 1 or isinstance(loss, bool) or not isinstance(loss, (Tensor, float, int)):
        return loss
    if owner._engine.contributors != owner.world_size:
        return loss  # a rank that has joined takes part in gradient rounds only
    if isinstance(loss, Tensor) and loss.numel() != 1:
        return loss
    value = torch.tensor([float(loss)], dtype=torch.float64)
    with stalls.inspected(owner._engine.progress, "the reduction of the closure's loss"):
        collectives.all_reduce(value, op="mean" if owner.reduce_op == "mean" else "sum", group=owner._group())
    if isinstance(loss, Tensor):
        return value.to(dtype=loss.dtype, device=loss.device).reshape(loss.shape)
    return value.item()
