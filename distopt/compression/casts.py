"""``compression="fp16"`` and ``"bf16"``: float packs travel as 16-bit floats.

The cheapest compressor: half the bytes, no state, one collective. The engine casts
inline (:meth:`Compressor.wire_dtype`), so a cast costs no codec machinery. The mean's
``1/world`` is applied before the cast, so a sum of large gradients cannot overflow
float16 on the way.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from .protocol import Codec, Compressor, PackLayout

__all__ = ["Cast"]

_CASTABLE = (torch.float32, torch.float64)
_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class Cast(Compressor):
    """Send float32/float64 packs as a 16-bit float type.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype`` (``"float16"``).
        ValueError: ``dtype`` is not a 16-bit float type.

    Example::

        >>> opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                    compression=distopt.compression.Cast(torch.bfloat16))
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Cast(dtype=) must be a torch.dtype (torch.float16 or torch.bfloat16), got "
                            f"{type(dtype).__name__} {dtype!r}")
        if dtype not in _NAMES:
            raise ValueError(f"Cast(dtype=) must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        self.name = _NAMES[dtype]

    def __repr__(self) -> str:
        return f"Cast({self.dtype})"

    def codec(self, layout: PackLayout) -> Optional[Codec]:
        return None  # never asked: the engine casts through wire_dtype()

    def wire_dtype(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        return self.dtype if dtype in _CASTABLE else None

    def casts_only(self) -> bool:
        return True  # codec() is never asked

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        return 2.0 / torch.empty(0, dtype=dtype).element_size() if dtype in _CASTABLE else 1.0

    def settings(self) -> Dict[str, Any]:
        return {"compressor": "Cast", "dtype": str(self.dtype)}
