"""Compression: what a pack sends instead of its float values (``DistributedOptimizer(compression=)``).

A compressor is an object (the protocol is :mod:`distopt.compression.protocol`) or one
of these names:

========== =============================================== ================================
name       object                                          bytes sent, against float32
========== =============================================== ================================
``fp16``   ``Cast(torch.float16)``                         1/2
``bf16``   ``Cast(torch.bfloat16)``                        1/2
``int8``   ``Quantize(bits=8)``, error feedback             about 1/4
``int4``   ``Quantize(bits=4)``, error feedback             about 1/8
``powersgd`` ``PowerSGD(rank=4)``, error feedback, warm start r (n + m) / (n m) per matrix
``topk``   ``TopK(group_size=64)``, error feedback           3/256: one value (bf16) and its position in 64
========== =============================================== ================================
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .casts import Cast
from .powersgd import PowerSGD
from .protocol import AllGather, AllReduce, AllToAll, Codec, Collective, Compressor, Outcome, PackLayout, Round
from .quantize import Quantize
from .topk import TopK

__all__ = ["Compressor", "Codec", "PackLayout", "Round", "Outcome", "AllReduce", "AllGather", "AllToAll", "Collective",
           "Cast", "PowerSGD", "Quantize", "TopK", "NAMES", "resolve"]

#: The names ``compression=`` accepts, and what each builds.
NAMES = {
    "fp16": lambda: Cast(torch.float16),
    "bf16": lambda: Cast(torch.bfloat16),
    "int8": lambda: Quantize(bits=8),
    "int4": lambda: Quantize(bits=4),
    "powersgd": lambda: PowerSGD(),
    "topk": lambda: TopK(),
}


def resolve(compression: Any) -> Optional[Compressor]:
    """The compressor ``compression=`` asks for: None, a name of :data:`NAMES`, or a :class:`Compressor`.

    Raises:
        ValueError: an unknown name.
        TypeError: neither None, a name nor a Compressor.
    """
    if compression is None or compression == "none":
        return None
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, str):
        if compression not in NAMES:
            raise ValueError(
                f"compression must be None, one of {', '.join(repr(n) for n in NAMES)} or a "
                f"distopt.compression.Compressor, got {compression!r}"
            )
        return NAMES[compression]()
    if isinstance(compression, type) and issubclass(compression, Compressor):
        raise TypeError(f"compression={compression.__name__} is a class; pass an instance, e.g. {compression.__name__}()")
    raise TypeError(
        f"compression must be None, a name ({', '.join(NAMES)}) or a distopt.compression.Compressor, "
        f"got {type(compression).__name__} {compression!r}"
    )
