"""Synchronous data parallelism: every step applies gradients averaged over all ranks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from .. import collectives
from ..transport import stalls
from .base import Mode, ModeContext

__all__ = ["Synchronous", "synchronizing", "shadow_closure_loss"]


class Synchronous(Mode):
    """Synchronous data parallelism, the default: average every gradient during backward, then step.

    ``.grad`` is final when ``backward()`` returns, so clipping and ``GradScaler`` see the
    averaged gradients. With a ``closure`` (e.g. LBFGS), every call of it is a fresh forward and
    backward, and is followed by a reduction of the gradients it computed and of the loss it
    returned: LBFGS's line search and stopping tests read the loss, so every rank must read the
    same one or the ranks take different steps and call the closure a different number of times.

    It takes no arguments; a mode object serves one wrapper.

    Example::

        >>> model = Net()
        >>> opt = distopt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                                    mode=distopt.Synchronous())
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()   # gradients are averaged during backward
        ...     opt.step()
    """

    reduces_in_backward = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def step(self, ctx: ModeContext, closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            ctx.reduce_for_step()
            return ctx.optimizer.step()
        return ctx.optimizer.step(synchronizing(ctx, closure))


def synchronizing(ctx: ModeContext, closure: Callable[[], Any]) -> Callable[[], Any]:
    """``closure`` followed by a reduction of the gradients it computed and of the loss it returned.

    Its round carries the closure flag (:mod:`distopt.planning.control`), so that a rank
    that has joined knows a reduction of the loss follows and takes part in it
    (:func:`shadow_closure_loss`): every closure call is one gradient round and one
    reduction of the loss, on every rank alike.
    """
    def reduced_closure() -> Any:
        engine = ctx.engine
        engine.reset_round()  # each closure call is a fresh forward and backward
        with engine.announce(closure=ctx.world_size > 1):
            with torch.enable_grad():
                loss = closure()
            ctx.synchronize()  # at once, before the inner optimizer reads the gradients
        return _reduced_loss(ctx, loss)

    return reduced_closure


def shadow_closure_loss(ctx: ModeContext) -> None:
    """As a rank that has joined: take part, with nothing, in the reduction of a closure's loss that
    follows the others' last round (its control flags said it was a closure's)."""
    _sum_of_losses(ctx, None)


def _reduced_loss(ctx: ModeContext, loss: Any) -> Any:
    """The losses of the ranks that contributed, reduced like their gradients, the same on every rank.

    The mean over the contributing ranks (over the world with ``divide_by_world=True``, where the
    joined ranks count as zeros), or the sum with ``reduce_op="sum"``. A loss of another type (None,
    a tuple) is returned as it is: every rank then gets its own, as the inner optimizer would have.
    """
    if ctx.world_size == 1:
        return loss
    total, count = _sum_of_losses(ctx, loss)
    if not _is_scalar(loss) or count == 0:
        return loss
    engine = ctx.engine
    value = total if ctx.reduce_op != "mean" else total / (ctx.world_size if engine.join.divide_by_world else count)
    if isinstance(loss, Tensor):
        return torch.tensor(value, dtype=torch.float64).to(dtype=loss.dtype, device=loss.device).reshape(loss.shape)
    return value


def _sum_of_losses(ctx: ModeContext, loss: Any) -> Tuple[float, int]:
    """The sum of the ranks' scalar losses and their number (a joined rank's ``None`` adds nothing).

    Every rank takes part after every closure round, whatever its closure returned, so that the
    collectives stay paired.
    """
    scalar = _is_scalar(loss)
    mine = float(loss.detach() if isinstance(loss, Tensor) else loss) if scalar else 0.0
    value = torch.tensor([mine, float(scalar)], dtype=torch.float64)
    with stalls.inspected(ctx.progress, "the reduction of the closure's loss"):
        collectives.all_reduce(value, op="sum", group=ctx.group)
    total, count = value.tolist()
    return total, int(round(count))


def _is_scalar(loss: Any) -> bool:
    if isinstance(loss, bool):
        return False
    if isinstance(loss, Tensor):
        return loss.numel() == 1
    return isinstance(loss, (float, int))
