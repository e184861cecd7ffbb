"""Collectives on picklable Python objects, and :func:`collect_results` built on them.

Each takes ``group=None`` and behaves like a world of one without a process
group. :func:`collect_results` gathers a sharded evaluation's results on rank 0,
through files in a shared directory (``device="cpu"``) or through the backend.

Every rank serializes its part before anything is sent and always takes part in
the exchange, sending why when it could not: an object that cannot be pickled
raises ``TypeError`` on its rank and on every rank that would receive it, instead
of leaving them waiting.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ._checks import check_rank
from .groups import group_and_size, get_rank, get_world_size

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "collect_results",
    "Dumps",
    "broadcast_serialized",
    "all_gather_serialized",
]


#: Serializes an object to bytes (``pickle.dumps``; ``distopt.horovod`` passes cloudpickle's).
Dumps = Callable[[Any], bytes]
_PICKLE_HINT = ("pass picklable objects: module-level functions and classes (no lambdas or local functions), "
                "no open files, locks or sockets")


def _serialize(obj: Any, dumps: Dumps) -> Tuple[Optional[bytes], Optional[BaseException]]:
    """``(bytes, None)``, or ``(None, the error)`` when ``obj`` cannot be serialized."""
    try:
        return dumps(obj), None
    except Exception as error:  # PicklingError, TypeError, AttributeError, RecursionError, a __reduce__'s own...
        return None, error


def _cannot_serialize(what: str, whose: str, obj_type: str, error: str, hint: str) -> TypeError:
    return TypeError(f"{what}: {whose} cannot be serialized (a {obj_type}: {error}), so no rank received "
                     f"anything and every rank of the group raises this error; {hint}")


def broadcast_serialized(data: List[Any], src: int, group: ProcessGroup, dumps: Dumps, what: str, hint: str,
                          item: str = "data[{i}]") -> List[Any]:
    """Broadcast the source's items serialized by ``dumps``, or, when one cannot be, why.

    The source serializes before anything is sent and always sends one message, so a
    failure there raises the same ``TypeError`` on every rank instead of leaving them waiting.
    ``item`` names the ``i``-th item in that message.
    """
    mine = dist.get_rank(group) == src
    message: List[Any] = [None]
    failure: Optional[BaseException] = None
    if mine:
        blobs = []
        for i, obj in enumerate(data):
            blob, failure = _serialize(obj, dumps)
            if failure is not None:
                message = [("failed", (i, type(obj).__name__, f"{type(failure).__name__}: {failure}"))]
                break
            blobs.append(blob)
        else:
            message = [("ok", blobs)]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, src), group=group)
    status, body = message[0]
    if status != "ok":
        i, obj_type, error = body
        raise _cannot_serialize(what, f"{item.format(i=i)} on rank {src}", obj_type, error, hint) from failure
    if not mine:
        if len(body) != len(data):
            raise ValueError(f"{what}: data has {len(data)} items on this rank but {len(body)} on the source "
                             f"(rank {src}); pass a list of the same length on every rank")
        data[:] = [pickle.loads(blob) for blob in body]
    return data


def all_gather_serialized(obj: Any, group: ProcessGroup, dumps: Dumps, what: str, hint: str) -> List[Any]:
    """Every rank's ``obj`` serialized by ``dumps``; a rank that cannot serialize its object makes
    every rank raise the same ``TypeError`` (it still takes part, so no rank waits for it)."""
    blob, failure = _serialize(obj, dumps)
    mine = ("ok", blob) if failure is None else ("failed", (type(obj).__name__, f"{type(failure).__name__}: {failure}"))
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [(r, body) for r, (status, body) in enumerate(everyone) if status != "ok"]
    if failed:
        (first, (obj_type, error)), others = failed[0], [r for r, _ in failed[1:]]
        whose = f"the object of rank {first}" + (f" (and of rank(s) {others})" if others else "")
        raise _cannot_serialize(what, whose, obj_type, error, hint) from failure
    return [pickle.loads(body) for _, body in everyone]


def broadcast_object_list(data: List[Any], src: int = 0, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Overwrite the items of ``data`` on every rank with rank ``src``'s, in place.

    Args:
        data: a list of picklable objects, of one length on every rank.
        src: the sending rank within ``group``.
        group: the process group; default: the world.

    Returns:
        ``data``.

    Raises:
        TypeError: ``data`` is not a list, or an item on ``src`` cannot be pickled (on every rank:
            nothing is sent, no rank is left waiting).
        ValueError: ``src`` out of range, or ``data`` is shorter or longer here than on ``src``.
    """
    if not isinstance(data, list):
        raise TypeError(f"data must be a list (it is filled in place), got {type(data).__name__}; pass [obj]")
    group, world_size = group_and_size(group)
    check_rank(src, "src", world_size)
    if group is None or world_size == 1:
        return data
    return broadcast_serialized(data, src, group, pickle.dumps, "broadcast_object_list", _PICKLE_HINT)


def all_gather_object(data: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Gather a picklable object from every rank, to every rank; ``[data]`` in one process.

    Raises:
        TypeError: a rank's object cannot be pickled (on every rank: no rank is left waiting).
    """
    group, world_size = group_and_size(group)
    if group is None or world_size == 1:
        return [data]
    return all_gather_serialized(data, group, pickle.dumps, "all_gather_object", _PICKLE_HINT)


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
        TypeError: on a rank whose object cannot be pickled, and on ``dst`` (the other ranks,
            which receive nothing, return None); every rank still takes part, so none waits.
    """
    group, world_size = group_and_size(group)
    check_rank(dst, "dst", world_size)
    if group is None or world_size == 1:
        return [data]
    blob, failure = _serialize(data, pickle.dumps)
    mine = ("ok", blob) if failure is None else ("failed", f"{type(failure).__name__}: {failure}")
    receiving = dist.get_rank(group) == dst
    out: Optional[List[Any]] = [None] * world_size if receiving else None
    dist.gather_object(mine, out, dst=dist.get_global_rank(group, dst), group=group)
    if failure is not None:
        raise _cannot_serialize("gather_object", f"the object of this rank ({dist.get_rank(group)})",
                                type(data).__name__, mine[1], _PICKLE_HINT) from failure
    if out is None:
        return None
    failed = [r for r, (status, _) in enumerate(out) if status != "ok"]
    if failed:
        raise TypeError(f"gather_object: the object of rank(s) {failed} cannot be pickled ({out[failed[0]][1]}); "
                        f"those ranks raise saying why; {_PICKLE_HINT}")
    return [pickle.loads(body) for _, body in out]


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
    group, world_size = group_and_size(group)
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
    blob, failure = _serialize(results, pickle.dumps)
    if blob is not None:
        with open(os.path.join(workdir, f"part_{rank}.pkl"), "wb") as f:
            f.write(blob)
    # Also the barrier after the writes: a rank that could not pickle its results says so, and every rank raises.
    failures = all_gather_object(None if failure is None else f"{type(failure).__name__}: {failure}", group)
    failed = [r for r, error in enumerate(failures) if error is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        raise _cannot_serialize("collect_results", f"the results of rank {failed[0]}"
                                + (f" (and of rank(s) {failed[1:]})" if failed[1:] else ""), "list",
                                failures[failed[0]], _PICKLE_HINT) from failure
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
