"""Synchronous data parallelism: every step applies gradients averaged over all ranks."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .base import Mode

if TYPE_CHECKING:
    from ..optimizer import DistributedOptimizer

__all__ = ["SynchronousMode"]


class SynchronousMode(Mode):
    """Average every gradient during backward, then run the inner optimizer.

    With a ``closure`` (e.g. LBFGS), every call of it is a fresh forward and
    backward, and is followed by a reduction of the gradients it computed.
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
        return loss

    return reduced_closure
