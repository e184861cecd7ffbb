"""Collective helpers on torch.distributed that also work in a single process.

Every helper takes ``group=None`` (the default process group) and behaves like a
world of one when no process group is initialized: reductions are the identity,
gathers return ``[data]``, broadcasts return their input. Arguments are checked
the same way in one process as in many, so a wrong ``op`` or ``src`` fails on a
laptop too. ``src`` and ``dst`` are ranks *within* ``group``.

Tensor helpers first agree on the tensors' shapes and dtypes across ranks, so a
mismatch raises the same clear error on every rank instead of hanging, and
move tensors the backend cannot use (CPU tensors under NCCL, CUDA tensors under
gloo) to a device it can, moving the result back.
"""
from __future__ import annotations

import functools
import os
import pickle
import shutil
import tempfile
import warnings
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .packing import flatten, get_offsets, param_pack_concat, param_pack_split, split

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_dist_info",
    "barrier",
    "synchronized",
    "all_reduce",
    "all_gather",
    "gather",
    "broadcast",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "sync_random_seed",
    "collect_results",
    "all_reduce_params",
    "all_reduce_dict",
    "bcast_list_",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "get_offsets",
    "param_pack_concat",
    "param_pack_split",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_OPS = ("sum", "mean", "min", "max", "product")
# A name from _OPS, or the matching torch.distributed.ReduceOp member.
_Op = Union[str, "dist.ReduceOp.RedOpType"]


# ---------------------------------------------------------------------------
# who am I


def is_distributed() -> bool:
    """Whether torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _resolve_group(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """The one place where ``group=None`` becomes the default group (or None without one)."""
    if group is not None:
        return group
    if not is_distributed():
        return None
    return dist.group.WORLD


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """Rank of this process in ``group`` (default: the world); 0 without a process group."""
    group = _resolve_group(group)
    return 0 if group is None else dist.get_rank(group)


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of processes in ``group`` (default: the world); 1 without a process group."""
    group = _resolve_group(group)
    return 1 if group is None else dist.get_world_size(group)


def get_local_rank() -> int:
    """Index of this process on its machine; 0 without a process group.

    Read from ``LOCAL_RANK`` (set by :func:`distopt.launch` and torchrun); a
    group set up without it is taken to be on one machine, so the global rank.
    """
    if not is_distributed():
        return 0
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def get_dist_info(group: Optional[ProcessGroup] = None) -> Tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group``."""
    return get_rank(group), get_world_size(group)


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank of ``group`` reaches this call; a no-op in one process."""
    group = _resolve_group(group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def synchronized(fn: Optional[_F] = None, *, group: Optional[ProcessGroup] = None) -> Any:
    """Decorator: after the function returns, wait at a barrier for every rank of ``group``.

    Use it bare (``@synchronized``) or with a group (``@synchronized(group=g)``),
    e.g. around code where rank 0 writes a file the others then read. If the
    function raises, no barrier is entered. A plain call in one process.

    Args:
        fn: the function (given when used bare).
        group: the group to synchronize; default: the world.

    Returns:
        The wrapped function, or a decorator when ``fn`` is not given.
    """
    if fn is None:
        return functools.partial(synchronized, group=group)
    if not callable(fn):
        raise TypeError(f"synchronized decorates a function; got {fn!r}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        barrier(group)
        return result

    return wrapper


# ---------------------------------------------------------------------------
# argument checks (run in one process too)


def _world(group: Optional[ProcessGroup]) -> Tuple[Optional[ProcessGroup], int]:
    group = _resolve_group(group)
    return group, (1 if group is None else dist.get_world_size(group))


def _check_tensor(value: Any, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}; wrap it with torch.as_tensor")
    return value


def _check_op(op: _Op, tensors: Iterable[Tensor], name: str) -> str:
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


def _check_rank(value: Any, name: str, world_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int rank within the group, got {value!r}")
    if not 0 <= value < world_size:
        raise ValueError(
            f"{name}={value} is out of range for a group of {world_size} rank(s); pass a rank in 0..{world_size - 1}"
        )
    return value


def _agree(mine: Any, what: str, fix: str, group: ProcessGroup) -> None:
    """Gather ``mine`` from every rank; raise the same error on every rank if they differ."""
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


def _layout(t: Tensor) -> Tuple[Tuple[int, ...], str]:
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


def _to_comm(t: Tensor, device: torch.device) -> Tensor:
    """``t`` itself if the backend can use it as is, else a contiguous copy on ``device``."""
    if t.device == device and t.is_contiguous():
        return t
    return t.to(device).contiguous()


def _restore(t: Tensor, work: Tensor) -> None:
    if work is not t:
        with torch.no_grad():
            t.copy_(work)


def _reduce(work: Tensor, op: str, group: ProcessGroup) -> None:
    torch_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}[op]
    dist.all_reduce(work, torch_op, group=group)
    if op == "mean":
        # ReduceOp.AVG exists for NCCL only; SUM then divide works everywhere.
        work.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------
# tensor collectives


def all_reduce(data: Tensor, op: _Op = "sum", group: Optional[ProcessGroup] = None) -> Tensor:
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
    _check_tensor(data, "data")
    op = _check_op(op, [data], "data")
    group, world_size = _world(group)
    if group is None or world_size == 1:
        return data
    _agree(_layout(data), "data's (shape, dtype)", "pass tensors of one shape and dtype on every rank", group)
    work = _to_comm(data, _comm_device(group, data))
    _reduce(work, op, group)
    _restore(data, work)
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
    padded = torch.zeros(max(numels), dtype=data.dtype, device=device)
    padded[: data.numel()].copy_(data.reshape(-1))
    if dst is not None and dist.get_rank(group) != dst:
        dist.gather(padded, None, dst=dist.get_global_rank(group, dst), group=group)
        return []
    slots = [torch.empty_like(padded) for _ in layouts]
    if dst is None:
        dist.all_gather(slots, padded, group=group)
    else:
        dist.gather(padded, slots, dst=dist.get_global_rank(group, dst), group=group)
    return [s[:n].view(shape).to(data.device) for s, n, (shape, _) in zip(slots, numels, layouts)]


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
    _check_tensor(data, "data")
    group, world_size = _world(group)
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
    _check_tensor(data, "data")
    group, world_size = _world(group)
    _check_rank(dst, "dst", world_size)
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
    _check_tensor(data, "data")
    group, world_size = _world(group)
    _check_rank(src, "src", world_size)
    if group is None or world_size == 1:
        return data
    _agree(_layout(data), "data's (shape, dtype)", "pass tensors of one shape and dtype on every rank", group)
    work = _to_comm(data, _comm_device(group, data))
    dist.broadcast(work, dist.get_global_rank(group, src), group=group)
    _restore(data, work)
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
    group, world_size = _world(group)
    if group is None or world_size == 1:
        return seed
    shared = torch.tensor([seed], dtype=torch.int64, device=_comm_device(group, torch.empty(0)))
    dist.broadcast(shared, dist.get_global_rank(group, 0), group=group)
    return int(shared.item())


# ---------------------------------------------------------------------------
# object collectives


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


# ---------------------------------------------------------------------------
# coalesced collectives on many tensors


def _check_tensors(values: Iterable[Any], name: str) -> List[Tensor]:
    if isinstance(values, Tensor):
        raise TypeError(f"{name} must be an iterable of tensors, got a single tensor; pass [tensor]")
    tensors = list(values)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return tensors


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
            flat = flatten(bucket).to(_comm_device(group, bucket[0]))
            collective(flat)
            if write_back:
                for t, synced in zip(bucket, split(flat.to(bucket[0].device), bucket)):
                    t.copy_(synced)


def all_reduce_params(params: Iterable[Tensor], coalesce: bool = True, bucket_size_mb: float = -1,
                      op: _Op = "sum", group: Optional[ProcessGroup] = None) -> None:
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
    tensors = [t.data if isinstance(t, nn.Parameter) else t for t in _check_tensors(params, "params")]
    op = _check_op(op, tensors, "params")
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not (
        bucket_size_mb > 0 or bucket_size_mb == -1
    ):
        raise ValueError(
            f"bucket_size_mb must be a positive number of megabytes or -1 (no limit), got {bucket_size_mb!r}"
        )
    group, world_size = _world(group)
    if group is None or world_size == 1 or not tensors:
        return
    _agree([_layout(t) for t in tensors], "params' (shape, dtype) list",
           "pass the same tensors in the same order on every rank", group)
    if not coalesce:
        for t in tensors:
            work = _to_comm(t, _comm_device(group, t))
            _reduce(work, op, group)
            _restore(t, work)
        return
    bucket_bytes = None if bucket_size_mb == -1 else max(1, int(bucket_size_mb * 1024 * 1024))
    _coalesced(tensors, bucket_bytes, group, lambda flat: _reduce(flat, op, group), write_back=True)


def all_reduce_dict(data: Mapping[str, Tensor], op: _Op = "sum",
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
        _check_tensor(value, f"data[{key!r}]")
    averaging_ints = _check_op(op, (), "data") == "mean"
    out = {
        key: (value.detach().to(torch.get_default_dtype())
              if averaging_ints and not (value.is_floating_point() or value.is_complex())
              else value.detach().clone())
        for key, value in data.items()
    }
    op = _check_op(op, out.values(), "data")
    group, world_size = _world(group)
    if group is None or world_size == 1 or not out:
        return out
    keys = sorted(out)
    _agree([(key, *_layout(out[key])) for key in keys], "data's (key, shape, dtype) list",
           "log the same keys with the same shapes and dtypes on every rank", group)
    _coalesced([out[key] for key in keys], None, group, lambda flat: _reduce(flat, op, group), write_back=True)
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
    tensors = _check_tensors(tensors, "tensors")
    group, world_size = _world(group)
    _check_rank(src, "src", world_size)
    if group is None or world_size == 1 or not tensors:
        return
    _agree([_layout(t) for t in tensors], "tensors' (shape, dtype) list",
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
        tensors = _check_tensors(source, "params_or_state_dict")
    unique = list({id(t): t for t in tensors}.values())  # tied weights are sent once
    bcast_list_([t.data if isinstance(t, nn.Parameter) else t for t in unique], src, group)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Give every rank rank ``src``'s optimizer state and hyperparameters, exactly.

    No optimizer step is taken to create missing state (Horovod does, which moves
    Adam's moments): the state is sent as it is, and an optimizer without state
    ends up without state everywhere. Each state tensor keeps ``src``'s dtype
    (``load_state_dict`` alone would cast e.g. NAdam's float32 ``mu_product`` to
    the parameters' dtype, and the ranks would drift apart bit by bit).

    Args:
        optimizer: the optimizer (the same parameter groups on every rank).
        src: the sending rank within ``group``.
        group: the process group; default: the world.

    Raises:
        ValueError: ``src`` out of range, or parameter groups that differ from ``src``'s.
    """
    group, world_size = _world(group)
    _check_rank(src, "src", world_size)
    if group is None or world_size == 1:
        return
    mine = dist.get_rank(group) == src
    payload = [_to_cpu(optimizer.state_dict()) if mine else None]
    broadcast_object_list(payload, src=src, group=group)
    if mine:
        return
    state_dict = payload[0]
    optimizer.load_state_dict(state_dict)
    for group_, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        for param, key in zip(group_["params"], saved_group["params"]):
            saved, loaded = state_dict["state"].get(key, {}), optimizer.state.get(param, {})
            for name, value in saved.items():
                if isinstance(value, Tensor) and isinstance(loaded.get(name), Tensor):
                    loaded[name] = loaded[name].to(value.dtype)


def _to_cpu(obj: Any) -> Any:
    # State pickled on the root's GPU would otherwise land on the root's GPU on every rank.
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
