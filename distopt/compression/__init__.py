"""Compression: what a pack sends instead of its float values (``DistributedOptimizer(compression=)``).

A compressor is an object (the protocol, with every method's contract, is
:mod:`distopt.compression.protocol`) or one of the names of :data:`NAMES`, each with what it
builds and sends (docs/compression.md has them as a table). Error feedback's helpers are in
:mod:`distopt.compression.feedback`, and :mod:`distopt.compression.testing` runs a
compressor's codecs for several simulated ranks in one process, for its tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from .casts import Cast
from .feedback import (Key, PackResiduals, ResidualOwner, fold_residual, keyed_state, load_keyed_state, load_residuals,
                       settle_residual)
from .powersgd import PowerSGD
from .protocol import AllGather, AllReduce, AllToAll, Codec, Collective, Compressor, Outcome, PackLayout, Round
from .quantize import Quantize
from .sign import Sign
from .topk import TopK

__all__ = ["Compressor", "Codec", "PackLayout", "Round", "Outcome", "AllReduce", "AllGather", "AllToAll", "Collective",
           "Cast", "PowerSGD", "Quantize", "Sign", "TopK", "NAMES", "Name", "resolve",
           "Key", "PackResiduals", "ResidualOwner", "fold_residual", "settle_residual", "keyed_state",
           "load_keyed_state", "load_residuals"]


@dataclass(frozen=True)
class Name:
    """What a name of :data:`NAMES` builds, and what it sends; calling it builds the compressor.

    Attributes:
        build: makes a fresh compressor (one compressor serves one wrapper).
        sends: what travels, in a few words, for lists of the names (``--help``, messages).
    """

    build: Callable[[], Compressor]
    sends: str

    def __call__(self) -> Compressor:
        return self.build()


#: The names ``compression=`` accepts, and what each builds. Every list of them (the README,
#: docs/compression.md's table, the examples' choices) is checked against it by the tests.
NAMES: Dict[str, Name] = {
    "fp16": Name(lambda: Cast(torch.float16), "16-bit floats: 1/2 of float32's bytes"),
    "bf16": Name(lambda: Cast(torch.bfloat16), "bfloat16: 1/2 of float32's bytes"),
    "int8": Name(lambda: Quantize(bits=8), "8-bit integers and a scale per 256 values, error feedback: about 1/4"),
    "int4": Name(lambda: Quantize(bits=4), "4-bit integers and a scale per 256 values, error feedback: about 1/8"),
    "powersgd": Name(lambda: PowerSGD(), "rank-4 factors of each matrix, error feedback: r (n + m) / (n m)"),
    "topk": Name(lambda: TopK(), "the largest of every 64 values, error feedback: 3/256"),
    "sign": Name(lambda: Sign(), "each value's sign and a scale per parameter, error feedback: about 1/32"),
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
