"""Collectives on many tensors at once: parameters, buffers, gradients, dicts of metrics.

The tensors of each (device, dtype) are flattened into one buffer per bucket
(packing's flatten/split), so a model's many small tensors cost a few large
collectives instead of one each.
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from ..planning.packing import flatten, split
from ._checks import check_op, check_rank, check_tensor, check_tensors, OpLike
from .groups import group_and_size
from .tensors import agree_across, layout_of, reduce_in_place, restore_from, to_comm

__all__ = [
    "all_reduce_params",
    "all_reduce_dict",
    "bcast_list_",
    "broadcast_parameters",
]


# ---------------------------------------------------------------------------
# buckets


def _buckets(tensors: Sequence[Tensor], bucket_bytes: Optional[int]) -> List[List[Tensor]]:
    """Group by (device, dtype) in first-seen order, each group cut into buckets of at most ``bucket_bytes``."""
    by_kind: Dict[Hashable, List[List[Tensor]]] = {}
    sizes: Dict[Hashable, int] = {}
    for t in tensors:
        kind = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        chunks = by_kind.setdefault(kind, [[]])
        if bucket_bytes is not None and chunks[-1] and sizes[kind] + nbytes > bucket_bytes:
            chunks.append([])
            sizes[kind] = 0
        chunks[-1].append(t)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return [chunk for chunks in by_kind.values() for chunk in chunks]


def _coalesced(tensors: Sequence[Tensor], bucket_bytes: Optional[int], group: ProcessGroup,
               collective: Callable[[Tensor], None], write_back: bool) -> None:
    """Run ``collective`` on one flat buffer per bucket (packing's flatten/split), then copy back."""
    for bucket in _buckets(tensors, bucket_bytes):
        with torch.no_grad():
            flat = to_comm(flatten(bucket), group)
            collective(flat)
            if write_back:
                for t, synced in zip(bucket, split(flat.to(bucket[0].device), bucket)):
                    t.copy_(synced)


# ---------------------------------------------------------------------------
# coalesced collectives on many tensors


def all_reduce_params(params: Iterable[Tensor], coalesce: bool = True, bucket_size_mb: float = -1,
                      op: OpLike = "sum", group: Optional[ProcessGroup] = None) -> None:
    """All-reduce parameters or buffers in place, a few large collectives instead of many small ones.

    Args:
        params: tensors (parameters, buffers, gradients) with the same shapes
            and dtypes, in the same order, on every rank.
        coalesce: flatten the tensors of each (device, dtype) into one buffer per bucket.
        bucket_size_mb: with ``coalesce``, the most megabytes per buffer; ``-1``: no limit.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"`` (or a ``ReduceOp``).
        group: the process group; default: the world.

    Raises:
        ValueError: unknown ``op``, a bad ``bucket_size_mb``, or tensors that differ between ranks.
        TypeError: a non-tensor in ``params``, or ``op="mean"`` on integer tensors.
    """
    tensors = [t.data if isinstance(t, nn.Parameter) else t for t in check_tensors(params, "params")]
    op = check_op(op, tensors, "params")
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not (
        bucket_size_mb > 0 or bucket_size_mb == -1
    ):
        raise ValueError(
            f"bucket_size_mb must be a positive number of megabytes or -1 (no limit), got {bucket_size_mb!r}"
        )
    group, world_size = group_and_size(group)
    if group is None or world_size == 1 or not tensors:
        return
    agree_across([layout_of(t) for t in tensors], "params' (shape, dtype) list",
           "pass the same tensors in the same order on every rank", group)
    if not coalesce:
        for t in tensors:
            work = to_comm(t, group)
            reduce_in_place(work, op, group)
            restore_from(t, work)
        return
    bucket_bytes = None if bucket_size_mb == -1 else max(1, int(bucket_size_mb * 1024 * 1024))
    _coalesced(tensors, bucket_bytes, group, lambda flat: reduce_in_place(flat, op, group), write_back=True)


def all_reduce_dict(data: Mapping[str, Tensor], op: OpLike = "sum",
                    group: Optional[ProcessGroup] = None) -> Dict[str, Tensor]:
    """Reduce a dict of tensors (e.g. logged metrics) across ranks, coalesced per (device, dtype).

    The inputs are left unchanged. Keys are matched by name, so their order may
    differ between ranks. With ``op="mean"``, integer tensors are averaged as
    floats (``torch.get_default_dtype()``).

    Args:
        data: tensors by key, with the same keys, shapes and dtypes on every rank.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"`` (or a ``ReduceOp``).
        group: the process group; default: the world.

    Returns:
        A new dict in ``data``'s key order with the reduced tensors (copies in one process).

    Raises:
        TypeError: a value is not a tensor or a key is not a string.
        ValueError: unknown ``op``, or keys/shapes/dtypes differ between ranks.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"data must be a dict of tensors, got {type(data).__name__}")
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"data's keys must be strings (ranks match them by name), got {key!r}")
        check_tensor(value, f"data[{key!r}]")
    averaging_ints = check_op(op, (), "data") == "mean"
    out = {
        key: (value.detach().to(torch.get_default_dtype())
              if averaging_ints and not (value.is_floating_point() or value.is_complex())
              else value.detach().clone())
        for key, value in data.items()
    }
    op = check_op(op, out.values(), "data")
    group, world_size = group_and_size(group)
    if group is None or world_size == 1 or not out:
        return out
    keys = sorted(out)
    agree_across([(key, *layout_of(out[key])) for key in keys], "data's (key, shape, dtype) list",
           "log the same keys with the same shapes and dtypes on every rank", group)
    _coalesced([out[key] for key in keys], None, group, lambda flat: reduce_in_place(flat, op, group), write_back=True)
    return out


def bcast_list_(tensors: Sequence[Tensor], src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Overwrite each tensor in place with rank ``src``'s, coalesced per (device, dtype).

    Args:
        tensors: tensors with the same shapes and dtypes, in the same order, on every rank.
        src: the sending rank within ``group``.
        group: the process group; default: the world.

    Raises:
        ValueError: ``src`` out of range, or the tensors differ between ranks.
        TypeError: a non-tensor in ``tensors``.
    """
    tensors = check_tensors(tensors, "tensors")
    group, world_size = group_and_size(group)
    check_rank(src, "src", world_size)
    if group is None or world_size == 1 or not tensors:
        return
    agree_across([layout_of(t) for t in tensors], "tensors' (shape, dtype) list",
           "pass the same tensors in the same order on every rank", group)
    source = dist.get_global_rank(group, src)
    _coalesced(tensors, None, group, lambda flat: dist.broadcast(flat, source, group=group),
               write_back=dist.get_rank(group) != src)


def broadcast_parameters(params_or_state_dict: Union[nn.Module, Mapping[str, Tensor], Iterable[Tensor]],
                         src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Give every rank rank ``src``'s parameters and buffers, in place, coalesced per (device, dtype).

    Args:
        params_or_state_dict: a module (its parameters and buffers), a state dict
            of tensors, or an iterable of tensors.
        src: the sending rank within ``group``.
        group: the process group; default: the world.

    Raises:
        TypeError: a state-dict value is not a tensor (broadcast those with broadcast_object_list).
        ValueError: ``src`` out of range, or the tensors differ between ranks.
    """
    source = params_or_state_dict
    if isinstance(source, nn.Module):
        tensors = list(source.parameters()) + list(source.buffers())
    elif isinstance(source, Mapping):
        for key, value in source.items():
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"params_or_state_dict[{key!r}] is a {type(value).__name__}, not a tensor; broadcast "
                    "non-tensor entries with broadcast_object_list"
                )
        tensors = list(source.values())
    else:
        tensors = check_tensors(source, "params_or_state_dict")
    unique = list({id(t): t for t in tensors}.values())  # tied weights are sent once
    bcast_list_([t.data if isinstance(t, nn.Parameter) else t for t in unique], src, group)

