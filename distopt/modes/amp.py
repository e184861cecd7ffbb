"""``torch.amp.GradScaler`` in local SGD: the wrapper takes every step and handles the scaling itself.

In synchronous training the gradients are averaged, so an inf on one rank is an
inf on every rank and ``GradScaler`` skips ``step()`` everywhere alike. In local
SGD the gradients stay local: an inf on one rank would skip ``step()`` on that
rank only, its step count would fall behind, and its syncs would pair with the
other ranks' syncs of other steps (or end in an "uneven batches" error).

So a local-SGD wrapper says ``_step_supports_amp_scaling`` (torch's protocol for
optimizers that scale themselves; the mode's :attr:`~distopt.modes.base.Mode.handles_amp_scaling`):
``GradScaler.step`` then always calls ``step()``, after setting ``grad_scale`` (the
scale the gradients still carry, None once ``scaler.unscale_`` ran) and ``found_inf``
on the wrapper, which hands both to the mode in its :class:`~distopt.modes.base.ModeContext`. The mode
skips the inner step when ``found_inf`` is set, as ``GradScaler`` would have, but
counts the step, so every rank's sync schedule stays the same; otherwise it
unscales the gradients exactly as ``GradScaler.unscale_`` does (the same kernel,
the same reciprocal) and steps.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from .base import ModeContext

__all__ = ["handed_over", "unscale_or_skip"]


def handed_over(ctx: ModeContext) -> bool:
    """Whether ``GradScaler.step`` is calling the wrapper's ``step()`` with its verdict (``found_inf``) set."""
    return ctx.found_inf is not None


def unscale_or_skip(ctx: ModeContext) -> bool:
    """Act on ``GradScaler``'s verdict: True when the inner step must be skipped (an inf or NaN gradient).

    Otherwise unscale the gradients if ``GradScaler`` left them scaled. Without a
    ``GradScaler`` (or with a disabled one) it does nothing and returns False.

    Raises:
        ValueError: float16 gradients to unscale (as ``GradScaler.unscale_`` says).
    """
    found_inf = ctx.found_inf
    if found_inf is None:
        return False
    if float(found_inf) != 0.0:
        return True
    scale = ctx.grad_scale
    if scale is not None:  # None: scaler.unscale_(opt) ran already
        _unscale(ctx, scale)
    return False


def _unscale(ctx: ModeContext, scale: Tensor) -> None:
    # As GradScaler.unscale_: the reciprocal in float64, then the fused check-and-multiply per device and dtype.
    inv_scale = scale.double().reciprocal().float()
    grads: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = defaultdict(list)
    with torch.no_grad():
        for group in ctx.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grad = p.grad._values() if p.grad.is_sparse else p.grad
                grads[(grad.device, grad.dtype)].append(grad)
        for (device, _), tensors in grads.items():
            unused = torch.zeros((), dtype=torch.float32, device=device)  # found_inf is GradScaler's already
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, unused, inv_scale.to(device))
