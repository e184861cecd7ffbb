"""Compression for ``compression=``, as Horovod names it: ``hvd.Compression.none``, ``.fp16``, ``.bf16``."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Type, Union

import torch
from torch import Tensor

__all__ = [
    "Compressor",
    "NoneCompressor",
    "FP16Compressor",
    "BF16Compressor",
    "Compression",
]


class Compressor:
    """Horovod's compression interface: ``compress`` before the wire, ``decompress`` after.

    The built-in compressors also tell :class:`DistributedOptimizer` which 16-bit
    type (``wire``) distopt's core should put packs in.
    """

    wire: Optional[str] = None

    @staticmethod
    def compress(tensor: Tensor) -> Tuple[Tensor, Any]:
        """Return the tensor to send and the context :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Tensor, ctx: Any) -> Tensor:
        """Undo :meth:`compress` given its context."""
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class _CastCompressor(Compressor):
    """Send floating-point tensors as ``dtype``; leave other tensors alone."""

    dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: Tensor) -> Tuple[Tensor, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating_point and tensor.dtype != cls.dtype:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Tensor, ctx: Any) -> Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16."""

    wire = "fp16"
    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (a distopt addition: float32's range, fewer bits)."""

    wire = "bf16"
    dtype = torch.bfloat16


class Compression:
    """The compressors, as Horovod names them: ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


CompressorLike = Union[Type[Compressor], Compressor]


def compressor_class(compression: Any) -> Type[Compressor]:
    cls = compression if isinstance(compression, type) else type(compression)
    if not issubclass(cls, Compressor):
        raise TypeError(
            f"compression must be hvd.Compression.none, hvd.Compression.fp16 or hvd.Compression.bf16, "
            f"got {compression!r}"
        )
    return cls
