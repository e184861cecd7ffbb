"""Argument checks the collective helpers run first, in one process too.

They need no communication, so a wrong ``op``, ``src``/``dst`` or argument type
fails the same way on a laptop as on many ranks. (The check that ranks agree
with each other, ``agree_across``, needs a collective and lives in :mod:`.tensors`.)
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Union

import torch.distributed as dist
from torch import Tensor

__all__: List[str] = ["OpLike", "check_tensor", "check_tensors", "check_op", "check_rank"]

_OPS = ("sum", "mean", "min", "max", "product")
# A name from _OPS, or the matching torch.distributed.ReduceOp member.
OpLike = Union[str, "dist.ReduceOp.RedOpType"]


def check_tensor(value: Any, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}; wrap it with torch.as_tensor")
    return value


def check_tensors(values: Iterable[Any], name: str) -> List[Tensor]:
    if isinstance(values, Tensor):
        raise TypeError(f"{name} must be an iterable of tensors, got a single tensor; pass [tensor]")
    tensors = list(values)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return tensors


def check_op(op: OpLike, tensors: Iterable[Tensor], name: str) -> str:
    """The op's name; ``ReduceOp`` members are accepted too, as torch.distributed takes them."""
    if isinstance(op, str):
        key: Optional[str] = op.lower()
    else:
        by_enum = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MIN: "min",
                   dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "product"}
        try:
            key = by_enum.get(op)
        except TypeError:  # unhashable
            key = None
    if key not in _OPS:
        raise ValueError(f"op must be one of {', '.join(repr(o) for o in _OPS)}, got {op!r}")
    if key == "mean":
        for t in tensors:
            if not (t.is_floating_point() or t.is_complex()):
                raise TypeError(
                    f"op='mean' cannot hold an average in {name} of dtype {t.dtype} in place; "
                    f"pass a floating-point tensor ({name}.float()) or use op='sum' and divide"
                )
    return key


def check_rank(value: Any, name: str, world_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int rank within the group, got {value!r}")
    if not 0 <= value < world_size:
        raise ValueError(
            f"{name}={value} is out of range for a group of {world_size} rank(s); pass a rank in 0..{world_size - 1}"
        )
    return value
