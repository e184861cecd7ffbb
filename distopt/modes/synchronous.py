"""Synchronous data parallelism: every step applies gradients averaged over all ranks."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import collectives
from ..transport import stalls
from .base import Mode, ModeArguments, ModeContext

__all__ = ["SynchronousMode", "synchronizing"]


class SynchronousMode(Mode):
    """Average every gradient during backward, then run the inner optimizer.

    With a ``closure`` (e.g. LBFGS), every call of it is a fresh forward and
    backward, and is followed by a reduction of the gradients it computed and of
    the loss it returned: LBFGS's line search and stopping tests read the loss,
    so every rank must read the same one or the ranks take different steps and
    call the closure a different number of times.
    """

    reduces_in_backward = True

    @classmethod
    def from_arguments(cls, args: ModeArguments) -> Optional["SynchronousMode"]:
        return cls()  # the default: last in the registry

    def step(self, ctx: ModeContext, closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            ctx.reduce_for_step()
            return ctx.optimizer.step()
        return ctx.optimizer.step(synchronizing(ctx, closure))


def synchronizing(ctx: ModeContext, closure: Callable[[], Any]) -> Callable[[], Any]:
    """``closure`` followed by a reduction of the gradients it computed and of the loss it returned."""
    def reduced_closure() -> Any:
        ctx.engine.reset_round()  # each closure call is a fresh forward and backward
        with torch.enable_grad():
            loss = closure()
        ctx.synchronize()  # at once, before the inner optimizer reads the gradients
        return _reduced_loss(ctx, loss)

    return reduced_closure


def _reduced_loss(ctx: ModeContext, loss: Any) -> Any:
    """The ranks' losses reduced like their gradients (the mean, or the sum), the same on every rank.

    A loss of another type (None, a tuple) is returned as it is: every rank then
    gets its own, as the inner optimizer would have.
    """
    if ctx.world_size == 1 or isinstance(loss, bool) or not isinstance(loss, (Tensor, float, int)):
        return loss
    if ctx.engine.contributors != ctx.world_size:
        return loss  # a rank that has joined takes part in gradient rounds only
    if isinstance(loss, Tensor) and loss.numel() != 1:
        return loss
    value = torch.tensor([float(loss)], dtype=torch.float64)
    with stalls.inspected(ctx.progress, "the reduction of the closure's loss"):
        collectives.all_reduce(value, op="mean" if ctx.reduce_op == "mean" else "sum", group=ctx.group)
    if isinstance(loss, Tensor):
        return value.to(dtype=loss.dtype, device=loss.device).reshape(loss.shape)
    return value.item()
