"""Collectives on picklable Python objects, and :func:`collect_results` built on them.

Each takes ``group=None`` and behaves like a world of one without a process
group. :func:`collect_results` gathers a sharded evaluation's results on rank 0,
through files in a shared directory (``device="cpu"``) or through the backend.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
from typing import Any, List, Optional, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ._checks import _check_rank
from .groups import _world, barrier, get_rank, get_world_size

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "collect_results",
]


def broadcast_object_list(data: List[Any], src: int = 0, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Overwrite the items of ``data`` on every rank with rank ``src``'s, in place.

    Args:
        data: a list of picklable objects, of one length on every rank.
        src: the sending rank within ``group``.
        group: the process group; default: the world.

    Returns:
        ``data``.

    Raises:
        TypeError: ``data`` is not a list.
        ValueError: ``src`` out of range.
    """
    if not isinstance(data, list):
        raise TypeError(f"data must be a list (it is filled in place), got {type(data).__name__}; pass [obj]")
    group, world_size = _world(group)
    _check_rank(src, "src", world_size)
    if group is None or world_size == 1:
        return data
    dist.broadcast_object_list(data, src=dist.get_global_rank(group, src), group=group)
    return data


def all_gather_object(data: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Gather a picklable object from every rank, to every rank; ``[data]`` in one process."""
    group, world_size = _world(group)
    if group is None or world_size == 1:
        return [data]
    out: List[Any] = [None] * world_size
    dist.all_gather_object(out, data, group=group)
    return out


def gather_object(data: Any, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Gather a picklable object from every rank to rank ``dst``.

    Args:
        data: this rank's object.
        dst: the receiving rank within ``group``.
        group: the process group; default: the world.

    Returns:
        On ``dst``: the objects in rank order. On other ranks: ``None``. ``[data]`` in one process.

    Raises:
        ValueError: ``dst`` out of range.
    """
    group, world_size = _world(group)
    _check_rank(dst, "dst", world_size)
    if group is None or world_size == 1:
        return [data]
    out: Optional[List[Any]] = [None] * world_size if dist.get_rank(group) == dst else None
    dist.gather_object(data, out, dst=dist.get_global_rank(group, dst), group=group)
    return out


# ---------------------------------------------------------------------------
# collect_results: a sharded evaluation's results, in dataset order


def _interleave(parts: Sequence[Sequence[Any]], size: int, stacklevel: int) -> List[Any]:
    """Undo a round-robin sampler split (rank r holds items r, r+W, ...) and drop its padding."""
    ordered = [part[i] for i in range(max(map(len, parts), default=0)) for part in parts if i < len(part)]
    if len(ordered) < size:
        warnings.warn(
            f"collect_results got {len(ordered)} results in all, fewer than size={size}; "
            "pass the dataset length as size and every rank's results",
            stacklevel=stacklevel + 1,
        )
    return ordered[:size]


def collect_results(results: Sequence[Any], size: int, device: str = "cpu", tmpdir: Optional[str] = None,
                    group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Collect per-rank results of a sharded evaluation on rank 0, in dataset order.

    Rank ``r`` is assumed to hold items ``r, r + W, r + 2W, ...`` (how
    ``DistributedSampler`` splits); the parts are interleaved back and cut to
    ``size``, which drops the sampler's padding.

    Args:
        results: this rank's results (picklable).
        size: the number of results wanted (the dataset's length).
        device: ``"cpu"`` passes the parts through files in ``tmpdir``;
            ``"gpu"`` passes them through the process group's backend.
        tmpdir: with ``"cpu"``, a directory every rank can read and write
            (shared between machines for multi-node runs); default: a fresh
            directory under the system temp dir, removed afterwards.
        group: the process group; default: the world.

    Returns:
        On rank 0 of ``group``: the ``size`` results in order. On other ranks: ``None``.
        In one process: ``results[:size]``.

    Raises:
        ValueError: unknown ``device``, ``tmpdir`` with ``"gpu"``, or a negative ``size``.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if device == "gpu" and tmpdir is not None:
        raise ValueError("tmpdir is only used with device='cpu'; drop tmpdir or pass device='cpu'")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be a non-negative int (the number of results wanted), got {size!r}")
    if isinstance(results, (str, bytes)) or not isinstance(results, Sequence):
        raise TypeError(f"results must be a list of this rank's results, got {type(results).__name__}")
    group, world_size = _world(group)
    if group is None or world_size == 1:
        return _interleave([results], size, stacklevel=2)
    if device == "gpu":
        parts = all_gather_object(list(results), group)
        return _interleave(parts, size, stacklevel=2) if dist.get_rank(group) == 0 else None
    return _collect_through_files(list(results), size, tmpdir, group)


def _collect_through_files(results: List[Any], size: int, tmpdir: Optional[str],
                           group: ProcessGroup) -> Optional[List[Any]]:
    rank, world_size = get_rank(group), get_world_size(group)
    # A fresh directory per call, so one call's clean-up never races the next call's files.
    where = [None]
    if rank == 0:
        if tmpdir is not None:
            os.makedirs(tmpdir, exist_ok=True)
        where = [tempfile.mkdtemp(prefix="distopt-collect-", dir=tmpdir)]
    workdir = broadcast_object_list(where, 0, group)[0]
    with open(os.path.join(workdir, f"part_{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    barrier(group)
    if rank != 0:
        return None
    try:
        parts = []
        for r in range(world_size):
            path = os.path.join(workdir, f"part_{r}.pkl")
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"collect_results found no results of rank {r} in {workdir}; with device='cpu' every rank "
                    "must see the same directory: pass a shared tmpdir, or use device='gpu'"
                )
            with open(path, "rb") as f:
                parts.append(pickle.load(f))
        return _interleave(parts, size, stacklevel=3)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
