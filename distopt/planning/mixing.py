"""Streaming local SGD's merge: a fragment's parameters once its sync has arrived.

When a fragment's exchange arrives, ``tau`` local steps after it was sent, every
rank holds the *globally updated* fragment (the last-sync copy moved by the mean
pseudo-gradient, or by the outer optimizer's step on it) and its own *local*
fragment, which trained on meanwhile. Streaming DiLoCo (Douillard et al. 2025,
section 2.3) mixes the two with a factor alpha::

    param = alpha * local + (1 - alpha) * global

``alpha = 0`` (the default, as in torchft) takes the global values and drops the
local steps made while the exchange was in flight; ``alpha = 1`` keeps the local
values (the sync then only moves the last-sync copies); the paper studies values in
between, which keep part of the steps made during the overlap. The last-sync copy becomes the global value whatever
alpha is, so the next pseudo-gradient is measured from the point every rank agrees on.
"""
from __future__ import annotations

from torch import Tensor

__all__ = ["mix_"]


def mix_(local: Tensor, global_: Tensor, alpha: float) -> Tensor:
    """``local`` becomes ``alpha * local + (1 - alpha) * global_``, in place; returns it.

    ``alpha = 0`` copies ``global_`` exactly (bit for bit, as plain local SGD takes the
    average), ``alpha = 1`` leaves ``local`` as it is; in between one ``lerp``.

    Raises:
        ValueError: ``alpha`` outside ``[0, 1]``.

    Example::

        local, global_ = torch.tensor([2.0]), torch.tensor([0.0])
        mix_(local, global_, 0.25)             # local is now [0.5]
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if alpha == 0.0:
        return local.copy_(global_)
    if alpha == 1.0:
        return local
    return local.lerp_(global_, 1.0 - alpha)
