"""Reduction ops: how :func:`~distopt.horovod.allreduce` combines tensors (``hvd.Average``, ``hvd.Sum``, ...)."""
from __future__ import annotations

import enum
import warnings
from typing import Any, Optional

import torch.distributed as dist

from .unsupported import ADASUM_ADVICE

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
]


class ReduceOp(enum.IntEnum):
    """How :func:`allreduce` combines tensors (Horovod's ``hvd.Average``, ``hvd.Sum``, ...)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,  # divided by size() around the sum
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def resolve_op(op: Optional[Any], average: Optional[bool]) -> ReduceOp:
    """Horovod's rules: ``average`` is deprecated, ``op`` wins, Average is the default."""
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them (op=hvd.Average).")
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed; use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=4,  # the caller of the public function that called reduction_spec()
        )
        return Average if average else Sum
    if op is None:
        return Average
    try:
        resolved = ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"op must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, got {op!r}"
        ) from None
    if resolved is Adasum:
        raise NotImplementedError(ADASUM_ADVICE)
    return resolved
