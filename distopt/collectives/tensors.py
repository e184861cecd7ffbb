"""Collectives on one tensor: all_reduce, all_gather, gather, broadcast, and sync_random_seed.

Tensor helpers first agree on the tensors' shapes and dtypes across ranks
(``agree_across``), so a mismatch raises the same clear error on every rank instead of
hanging, and move tensors the backend cannot use (CPU tensors under NCCL, CUDA
tensors under gloo) to a device it can, moving the result back. :mod:`.params`
uses the same helpers for many tensors at once.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ._checks import check_op, check_rank, check_tensor, OpLike
from .groups import group_and_size
from .objects import all_gather_object

__all__ = [
    "all_reduce",
    "all_gather",
    "gather",
    "broadcast",
    "sync_random_seed",
    "same_everywhere",
    "agree_across",
    "layout_of",
    "comm_dtype",
    "to_comm",
    "restore_from",
    "reduce_in_place",
]


# ---------------------------------------------------------------------------
# agreeing across ranks


def same_everywhere(text: str, group: ProcessGroup) -> bool:
    """Whether ``text`` is the same on every rank of ``group``: one gather of a 32-byte digest.

    The same answer on every rank. Cheaper than gathering pickled objects, whose first
    use in a process alone costs megabytes.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    digest = torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.int64).to(device)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, digest, group=group)
    return all(torch.equal(theirs, gathered[0]) for theirs in gathered)


def agree_across(mine: Any, what: str, fix: str, group: ProcessGroup) -> None:
    """Raise the same error on every rank if ``mine`` differs between ranks."""
    if same_everywhere(repr(mine), group):
        return
    everyone = all_gather_object(mine, group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(f"{what} must match on every rank, but {_difference(everyone[0], theirs, rank)}; {fix}")


def _difference(first: Any, other: Any, rank: int) -> str:
    if isinstance(first, list) and isinstance(other, list):
        if len(first) != len(other):
            return f"rank 0 has {len(first)} entries and rank {rank} has {len(other)}"
        i = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
        return f"entry {i} is {first[i]} on rank 0 and {other[i]} on rank {rank}"
    return f"rank 0 has {first} and rank {rank} has {other}"


def layout_of(t: Tensor) -> Tuple[Tuple[int, ...], str]:
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------
# moving tensors where the backend can use them


def _comm_device(group: ProcessGroup, like: Tensor) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        # gloo's CUDA support covers only some collectives; CPU covers all.
        return torch.device("cpu")
    return like.device


# dtypes gloo has no kernels for, and the wider dtype they travel as (exact for every value).
_GLOO_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def comm_dtype(group: ProcessGroup, dtype: torch.dtype) -> torch.dtype:
    if "gloo" in str(dist.get_backend(group)):
        return _GLOO_WIDER.get(dtype, dtype)
    return dtype


def to_comm(t: Tensor, group: ProcessGroup) -> Tensor:
    """``t`` itself if the backend can use it as is, else a contiguous copy it can use."""
    device, dtype = _comm_device(group, t), comm_dtype(group, t.dtype)
    if t.device == device and t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(device=device, dtype=dtype).contiguous()


def restore_from(t: Tensor, work: Tensor) -> None:
    if work is not t:
        with torch.no_grad():
            t.copy_(work)


def reduce_in_place(work: Tensor, op: str, group: ProcessGroup) -> None:
    torch_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}[op]
    dist.all_reduce(work, torch_op, group=group)
    if op == "mean":
        # ReduceOp.AVG exists for NCCL only; SUM then divide works everywhere.
        work.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------
# tensor collectives


def all_reduce(data: Tensor, op: OpLike = "sum", group: Optional[ProcessGroup] = None) -> Tensor:
    """Reduce ``data`` across ranks in place; every rank gets the result.

    Args:
        data: the tensor, with the same shape and dtype on every rank.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"`` (or a ``ReduceOp``).
        group: the process group; default: the world.

    Returns:
        ``data``, reduced (unchanged in one process).

    Raises:
        ValueError: unknown ``op``, or shapes/dtypes differ between ranks.
        TypeError: ``op="mean"`` on an integer tensor (it cannot hold the average).
    """
    check_tensor(data, "data")
    op = check_op(op, [data], "data")
    group, world_size = group_and_size(group)
    if group is None or world_size == 1:
        return data
    agree_across(layout_of(data), "data's (shape, dtype)", "pass tensors of one shape and dtype on every rank", group)
    work = to_comm(data, group)
    reduce_in_place(work, op, group)
    restore_from(data, work)
    return data


def _gather_padded(data: Tensor, group: ProcessGroup, dst: Optional[int]) -> List[Tensor]:
    """Gather tensors of any shapes (one dtype) by padding them to the largest; [] off ``dst``."""
    layouts = all_gather_object((tuple(data.shape), str(data.dtype)), group)
    dtypes = {dtype for _, dtype in layouts}
    if len(dtypes) > 1:
        detail = ", ".join(f"rank {r}: {dtype}" for r, (_, dtype) in enumerate(layouts))
        raise ValueError(f"data must have one dtype on every rank, got {detail}; convert with data.to(dtype)")
    numels = [int(np.prod(shape, dtype=np.int64)) for shape, _ in layouts]
    device = _comm_device(group, data)
    padded = torch.zeros(max(numels), dtype=comm_dtype(group, data.dtype), device=device)
    padded[: data.numel()].copy_(data.reshape(-1))
    if dst is not None and dist.get_rank(group) != dst:
        dist.gather(padded, None, dst=dist.get_global_rank(group, dst), group=group)
        return []
    slots = [torch.empty_like(padded) for _ in layouts]
    if dst is None:
        dist.all_gather(slots, padded, group=group)
    else:
        dist.gather(padded, slots, dst=dist.get_global_rank(group, dst), group=group)
    return [s[:n].view(shape).to(data.device, data.dtype) for s, n, (shape, _) in zip(slots, numels, layouts)]


def all_gather(data: Tensor, group: Optional[ProcessGroup] = None) -> List[Tensor]:
    """Gather ``data`` from every rank, to every rank.

    Ranks may pass different shapes (one dtype); each gathered tensor keeps its
    rank's shape.

    Args:
        data: this rank's tensor.
        group: the process group; default: the world.

    Returns:
        One tensor per rank, in rank order, on ``data``'s device; ``[data]`` in one process.

    Raises:
        ValueError: the dtypes differ between ranks.
    """
    check_tensor(data, "data")
    group, world_size = group_and_size(group)
    if group is None or world_size == 1:
        return [data]
    return _gather_padded(data, group, None)


def gather(data: Tensor, dst: int = 0, group: Optional[ProcessGroup] = None) -> List[Tensor]:
    """Gather ``data`` from every rank to rank ``dst``.

    Args:
        data: this rank's tensor; shapes may differ between ranks, dtypes may not.
        dst: the receiving rank within ``group``.
        group: the process group; default: the world.

    Returns:
        On ``dst``: one tensor per rank, in rank order. On other ranks: ``[]``.
        ``[data]`` in one process.

    Raises:
        ValueError: ``dst`` out of range, or the dtypes differ between ranks.
    """
    check_tensor(data, "data")
    group, world_size = group_and_size(group)
    check_rank(dst, "dst", world_size)
    if group is None or world_size == 1:
        return [data]
    return _gather_padded(data, group, dst)


def broadcast(data: Tensor, src: int = 0, group: Optional[ProcessGroup] = None) -> Tensor:
    """Overwrite ``data`` on every rank with rank ``src``'s, in place.

    Args:
        data: the tensor, with the same shape and dtype on every rank.
        src: the sending rank within ``group``.
        group: the process group; default: the world.

    Returns:
        ``data`` (unchanged in one process).

    Raises:
        ValueError: ``src`` out of range, or shapes/dtypes differ between ranks.
    """
    check_tensor(data, "data")
    group, world_size = group_and_size(group)
    check_rank(src, "src", world_size)
    if group is None or world_size == 1:
        return data
    agree_across(layout_of(data), "data's (shape, dtype)", "pass tensors of one shape and dtype on every rank", group)
    work = to_comm(data, group)
    dist.broadcast(work, dist.get_global_rank(group, src), group=group)
    restore_from(data, work)
    return data


def sync_random_seed(group: Optional[ProcessGroup] = None) -> int:
    """A random seed drawn on rank 0 and shared with every rank.

    Use it where ranks must shuffle alike (a distributed sampler). The seed comes
    from numpy's global generator, so ``np.random.seed`` makes it reproducible.

    Args:
        group: the process group; default: the world.

    Returns:
        The same int in ``[0, 2**31)`` on every rank; a fresh one in one process.
    """
    seed = int(np.random.randint(2**31))
    group, world_size = group_and_size(group)
    if group is None or world_size == 1:
        return seed
    shared = torch.tensor([seed], dtype=torch.int64, device=_comm_device(group, torch.empty(0)))
    dist.broadcast(shared, dist.get_global_rank(group, 0), group=group)
    return int(shared.item())
