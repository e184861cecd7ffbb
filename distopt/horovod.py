"""``import distopt.horovod as hvd``: Horovod's PyTorch API on torch.distributed, started by ``torchrun``.

A script written for ``horovod.torch`` runs unchanged except for its import
line, started with ``torchrun --nproc-per-node N script.py`` instead of
``horovodrun -np N python script.py``. The names, defaults and semantics follow
Horovod's PyTorch API; :class:`DistributedOptimizer` is distopt's
:class:`distopt.DistributedOptimizer` (packed all-reduces overlapping backward)
under Horovod's signature.

Where Horovod has sharp edges they are fixed rather than copied:

* :func:`broadcast_optimizer_state` copies the root's state without taking an
  optimizer step, so no rank's parameters or moments move;
* ``zero_grad(set_to_none=...)`` is accepted, and ``zero_grad()`` right after
  ``backward()`` is safe (distopt waits for in-flight reductions);
* misuse raises ``ValueError``/``RuntimeError`` (never ``AssertionError``);
* fp16 compression divides by the number of ranks *before* the 16-bit cast, so
  averaging large gradients does not overflow.

Collectives are matched by call order (torch.distributed), not by ``name``:
every rank must issue them in the same order. ``name`` arguments are accepted
and ignored.

Not provided: Adasum and process sets (they raise ``NotImplementedError`` saying
what to use instead), ``alltoall``, ``reducescatter``, ``SyncBatchNorm``,
``elastic`` and the timeline (accessing them raises ``AttributeError`` with the
torch equivalent).
"""
from __future__ import annotations

import contextlib
import enum
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from . import collectives
from .launcher import _under_torchrun
from .launcher import init as _init_process_group
from .launcher import shutdown as _destroy_process_group
from .optimizer import DistributedOptimizer as _CoreDistributedOptimizer

__all__ = [
    # life cycle and topology
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "cuda_built",
    "rocm_built",
    # reduction ops and compression
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compressor",
    "NoneCompressor",
    "FP16Compressor",
    "BF16Compressor",
    "Compression",
    # process sets (only the global one)
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    # tensor collectives
    "Handle",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "synchronize",
    "poll",
    "join",
    "barrier",
    # objects, models and optimizers
    "broadcast_object",
    "allgather_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "DistributedOptimizer",
]


# ====================================================================== life cycle


@dataclass
class _Session:
    initialized: bool = False
    owns_group: bool = False  # init() created the process group, so shutdown() destroys it
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1


_session = _Session()

_NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Join the job: set up the process group from ``torchrun``'s environment.

    Under ``torchrun`` this initializes the default process group (see
    :func:`distopt.launcher.init`: NCCL when every local rank has a GPU, else
    gloo). If a process group already exists (e.g. inside :func:`distopt.launch`)
    it is used as is. Started as a plain ``python script.py``, the script runs as
    a job of one process, as it would with Horovod. Every rank must call it: the
    ranks exchange host names to learn :func:`local_size` and :func:`cross_size`.
    Calling it again before :func:`shutdown` does nothing.

    Args:
        comm: an MPI communicator in Horovod; must be None.
        process_sets: Horovod process sets; must be None.

    Raises:
        NotImplementedError: if ``comm`` or ``process_sets`` is given.
    """
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) takes an MPI communicator, and distopt.horovod runs on torch.distributed "
            "without MPI; call hvd.init() and start the script with torchrun --nproc-per-node N"
        )
    if process_sets is not None:
        raise NotImplementedError(_PROCESS_SET_ADVICE)
    if _session.initialized:
        return
    if not collectives.is_distributed() and _under_torchrun():
        _init_process_group()
        _session.owns_group = True
    _learn_topology()
    _session.initialized = True


def _learn_topology() -> None:
    """Which ranks share this machine: one gather of every rank's host name at init."""
    me = collectives.get_rank()
    hosts = collectives.all_gather_object(socket.gethostname())
    machines = list(dict.fromkeys(hosts))  # in order of their first rank
    _session.local_rank = collectives.get_local_rank()
    _session.local_size = hosts.count(hosts[me])
    _session.cross_rank = machines.index(hosts[me])
    _session.cross_size = len(machines)


def shutdown() -> None:
    """Leave the job; destroys the process group if :func:`init` created it. Idempotent."""
    if _session.owns_group:
        _destroy_process_group()
    _session.initialized = False
    _session.owns_group = False


def is_initialized() -> bool:
    """Whether :func:`init` was called (and :func:`shutdown` was not since)."""
    return _session.initialized


def _require_init() -> None:
    if not _session.initialized:
        raise ValueError(_NOT_INITIALIZED)


def size() -> int:
    """Number of processes in the job.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return collectives.get_world_size()


def rank() -> int:
    """Rank of this process, ``0 .. size() - 1``.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return collectives.get_rank()


def local_size() -> int:
    """Number of processes on this machine (``torchrun --nproc-per-node``).

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.local_size


def local_rank() -> int:
    """Rank of this process on this machine, e.g. to pick its GPU.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.local_rank


def cross_size() -> int:
    """Number of machines in the job.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.cross_size


def cross_rank() -> int:
    """Index of this machine, machines numbered in the order of their lowest rank.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.cross_rank


def mpi_built() -> bool:
    """False: distopt runs on torch.distributed, without MPI."""
    return False


def mpi_enabled() -> bool:
    """False: distopt runs on torch.distributed, without MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI; torch.distributed collectives may be called from any thread."""
    return False


def gloo_built() -> bool:
    """Whether this torch build has the gloo backend."""
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Whether the job's process group uses gloo (for at least CPU tensors)."""
    return collectives.is_distributed() and "gloo" in str(dist.get_backend())


def nccl_built() -> bool:
    """Whether this torch build has the NCCL backend."""
    return dist.is_available() and dist.is_nccl_available()


def cuda_built() -> bool:
    """Whether this torch build supports CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether this torch build is for ROCm."""
    return torch.version.hip is not None


# ====================================================================== ops and compression


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

_TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,  # divided by size() around the sum
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
_ADASUM_ADVICE = (
    "Adasum is not supported by distopt.horovod; use op=hvd.Average (the default) and scale the "
    "learning rate by hvd.size() (or hvd.local_size() on GPUs) as the Horovod docs do for Average"
)


def _resolve_op(op: Optional[Any], average: Optional[bool]) -> ReduceOp:
    """Horovod's rules: ``average`` is deprecated, ``op`` wins, Average is the default."""
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them (op=hvd.Average).")
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed; use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=4,  # the caller of the public function that called _reduction()
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
        raise NotImplementedError(_ADASUM_ADVICE)
    return resolved


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


_CompressorLike = Union[Type[Compressor], Compressor]


def _compressor_class(compression: Any) -> Type[Compressor]:
    cls = compression if isinstance(compression, type) else type(compression)
    if not issubclass(cls, Compressor):
        raise TypeError(
            f"compression must be hvd.Compression.none, hvd.Compression.fp16 or hvd.Compression.bf16, "
            f"got {compression!r}"
        )
    return cls


# ====================================================================== process sets


_PROCESS_SET_ADVICE = (
    "Horovod process sets are not supported by distopt.horovod; every hvd collective spans all ranks. "
    "For a subgroup, create it with torch.distributed.new_group(ranks) and pass it as process_group= "
    "to distopt.DistributedOptimizer or as group= to torch.distributed collectives"
)


class ProcessSet:
    """Horovod's process sets are not supported; only :data:`global_process_set` exists.

    Raises:
        NotImplementedError: always, naming torch's equivalent.
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        raise NotImplementedError(_PROCESS_SET_ADVICE)


class _GlobalProcessSet:
    def __repr__(self) -> str:
        return "hvd.global_process_set"


#: All ranks: the only process set, accepted wherever Horovod takes ``process_set=``.
global_process_set = _GlobalProcessSet()


def add_process_set(process_set: Any) -> None:
    """Not supported.

    Raises:
        NotImplementedError: always, naming torch's equivalent.
    """
    raise NotImplementedError(_PROCESS_SET_ADVICE)


def remove_process_set(process_set: Any) -> None:
    """Not supported.

    Raises:
        NotImplementedError: always, naming torch's equivalent.
    """
    raise NotImplementedError(_PROCESS_SET_ADVICE)


def _check_process_set(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(_PROCESS_SET_ADVICE)


# ====================================================================== async handles


class Handle:
    """An operation in flight, returned by the ``*_async`` functions.

    Pass it to :func:`synchronize` for the result or to :func:`poll` to ask
    whether it finished.
    """

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Optional[Callable[[], Any]] = finish
        self._result: Any = None

    def done(self) -> bool:
        """Whether the communication has finished (the result may still need :meth:`wait`)."""
        return self._finish is None or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        """Block until the operation finished and return its result; the same result on every call."""
        if self._finish is not None:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._finish = None
            self._works = []
        return self._result


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its output.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The output tensor (a list of tensors for ``grouped_*``).

    Raises:
        TypeError: if ``handle`` is not a :class:`Handle`.
    """
    return _check_handle(handle).wait()


def poll(handle: Handle) -> bool:
    """Whether an asynchronous operation has finished, without blocking.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        True once :func:`synchronize` would not block on communication.

    Raises:
        TypeError: if ``handle`` is not a :class:`Handle`.
    """
    return _check_handle(handle).done()


def _check_handle(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(
            f"handle must be what an hvd.*_async function returned, got {type(handle).__name__}; "
            "for DistributedOptimizer's synchronization call optimizer.synchronize()"
        )
    return handle


# ====================================================================== allreduce


def _world() -> Optional[dist.ProcessGroup]:
    """The process group collectives run on, or None for a job of one process without a group."""
    _require_init()
    return dist.group.WORLD if collectives.is_distributed() else None


@dataclass(frozen=True)
class _Reduction:
    op: ReduceOp
    prescale: float
    postscale: float


def _wire_device(group: dist.ProcessGroup, tensor: Tensor) -> torch.device:
    # Horovod reduces CPU tensors (metrics) even when it runs on NCCL; NCCL needs them on the GPU.
    if dist.get_backend(group) == "nccl" and tensor.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def _on_wire(tensor: Tensor, group: Optional[dist.ProcessGroup], fresh: bool) -> Tensor:
    """A contiguous tensor the backend can send: ``tensor`` itself if possible (unless ``fresh``)."""
    device = tensor.device if group is None else _wire_device(group, tensor)
    if tensor.device == device and tensor.is_contiguous() and not fresh:
        return tensor
    return tensor.to(device, memory_format=torch.contiguous_format, copy=True)


def _start_allreduce(tensor: Tensor, out: Tensor, how: _Reduction, compression: Type[Compressor]) -> Handle:
    """Reduce ``tensor`` into ``out`` (which may be ``tensor`` itself) asynchronously."""
    group = _world()
    world = collectives.get_world_size(group)
    pre, post = how.prescale, how.postscale
    if how.op is Average and tensor.is_floating_point():
        pre /= world  # before the wire, so a 16-bit sum of large values cannot overflow
    with torch.no_grad():
        source = tensor.detach()
        compressed, ctx = compression.compress(source * pre if pre != 1.0 else source)
        # The reduction may write into the caller's tensor only when it asked for in place.
        wire = _on_wire(compressed, group, fresh=compressed is source and out is not tensor)
    work = None
    if group is not None and world > 1:
        work = dist.all_reduce(wire, op=_TORCH_OPS[how.op], group=group, async_op=True)

    def finish() -> Tensor:
        with torch.no_grad():
            result = compression.decompress(wire, ctx)
            if how.op is Average and not result.is_floating_point():
                result = result.div(world, rounding_mode="trunc")
            if post != 1.0:
                result = result * post
            if result.data_ptr() != out.data_ptr() or result.shape != out.shape:
                out.copy_(result)
            return out

    return Handle([work], finish)


_SUM = _Reduction(ReduceOp.SUM, 1.0, 1.0)


def _reduction(op: Optional[Any], average: Optional[bool], prescale_factor: float, postscale_factor: float,
               process_set: Any) -> _Reduction:
    _check_process_set(process_set)
    return _Reduction(_resolve_op(op, average), float(prescale_factor), float(postscale_factor))


class _AllreduceFunction(torch.autograd.Function):
    """Differentiable allreduce: the gradient is the same reduction of the incoming gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, how: _Reduction, compression: Type[Compressor]) -> Tensor:
        ctx.how = how
        ctx.compression = compression
        return _start_allreduce(tensor, torch.empty_like(tensor), how, compression).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None]:
        if ctx.how.op not in (Average, Sum):
            raise RuntimeError(
                f"hvd.allreduce(op={ctx.how.op.name.title()}) has no gradient; use op=hvd.Average or op=hvd.Sum "
                "for tensors that need one"
            )
        return _start_allreduce(grad, torch.empty_like(grad), ctx.how, ctx.compression).wait(), None, None


def allreduce(
    tensor: Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: _CompressorLike = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Tensor:
    """Average (or sum, min, max, multiply) ``tensor`` over all ranks; the input is not modified.

    Differentiable for Average and Sum: the gradient is reduced the same way.

    Args:
        tensor: the tensor to reduce; same shape and dtype on every rank.
        average: deprecated: True for Average, False for Sum; use ``op``.
        name: ignored (torch.distributed matches collectives by call order).
        compression: e.g. ``hvd.Compression.fp16`` to send float tensors in 16 bits.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        prescale_factor: multiplies ``tensor`` before the reduction.
        postscale_factor: multiplies the result.
        process_set: only ``hvd.global_process_set``.

    Returns:
        A new tensor with the reduced value.

    Raises:
        ValueError: if both ``op`` and ``average`` are given, or ``op`` is unknown.
        NotImplementedError: for ``hvd.Adasum`` or another process set.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _AllreduceFunction.apply(tensor, how, _compressor_class(compression))


def allreduce_async(
    tensor: Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start :func:`allreduce` of ``tensor`` into a new tensor; :func:`synchronize` returns it.

    Args: as :func:`allreduce`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _start_allreduce(tensor, torch.empty_like(tensor), how, NoneCompressor)


def allreduce_async_(
    tensor: Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start an in-place :func:`allreduce` of ``tensor``; :func:`synchronize` returns ``tensor``.

    Args: as :func:`allreduce`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _start_allreduce(tensor, tensor, how, NoneCompressor)


def allreduce_(
    tensor: Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Tensor:
    """In-place :func:`allreduce`.

    Args: as :func:`allreduce`.

    Returns:
        ``tensor``, now holding the reduced value.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _start_allreduce(tensor, tensor, how, NoneCompressor).wait()


def _grouped(handles: List[Handle]) -> Handle:
    return Handle([w for h in handles for w in h._works], lambda: [h.wait() for h in handles])


def grouped_allreduce_async(
    tensors: Sequence[Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start :func:`allreduce` of each tensor in ``tensors``; :func:`synchronize` returns the list.

    Args: as :func:`allreduce`, with a list of tensors.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _grouped([_start_allreduce(t, torch.empty_like(t), how, NoneCompressor) for t in tensors])


def grouped_allreduce_async_(
    tensors: Sequence[Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """In-place :func:`grouped_allreduce_async`.

    Args: as :func:`allreduce`, with a list of tensors.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _grouped([_start_allreduce(t, t, how, NoneCompressor) for t in tensors])


def grouped_allreduce(
    tensors: Sequence[Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: _CompressorLike = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> List[Tensor]:
    """:func:`allreduce` of each tensor in ``tensors``.

    Args: as :func:`allreduce`, with a list of tensors.

    Returns:
        New tensors with the reduced values.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    cls = _compressor_class(compression)
    return [_AllreduceFunction.apply(t, how, cls) for t in tensors]


def grouped_allreduce_(
    tensors: Sequence[Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> List[Tensor]:
    """In-place :func:`grouped_allreduce`.

    Args: as :func:`allreduce`, with a list of tensors.

    Returns:
        ``tensors``, now holding the reduced values.
    """
    how = _reduction(op, average, prescale_factor, postscale_factor, process_set)
    return _grouped([_start_allreduce(t, t, how, NoneCompressor) for t in tensors]).wait()


# ====================================================================== allgather


def _first_dims(tensor: Tensor, group: dist.ProcessGroup) -> List[int]:
    """Every rank's first dimension, after checking that the other dimensions and dtypes agree."""
    mine = (tuple(tensor.shape), str(tensor.dtype))
    everyone = collectives.all_gather_object(mine, group=group)
    for r, (shape, dtype) in enumerate(everyone):
        if dtype != mine[1]:
            raise ValueError(f"Mismatched allgather tensor types: rank {r} sent {dtype}, this rank {mine[1]}")
        if not shape or len(shape) != len(mine[0]) or shape[1:] != mine[0][1:]:
            raise ValueError(
                f"Mismatched allgather tensor shapes: rank {r} sent shape {list(shape)}, this rank "
                f"{list(mine[0])}; tensors must have at least one dimension and may differ in the first only"
            )
    return [shape[0] for shape, _ in everyone]


def _start_allgather(tensor: Tensor) -> Tuple[Handle, List[int]]:
    """Start gathering every rank's rows; also return every rank's row count."""
    group = _world()
    if group is None or collectives.get_world_size(group) == 1:
        if tensor.dim() == 0:
            raise ValueError("allgather needs a tensor with at least one dimension, got a scalar; use tensor.view(1)")
        return Handle([], lambda: tensor.detach().clone()), [tensor.shape[0]]
    dims = _first_dims(tensor, group)
    # all_gather needs one shape: pad every rank's rows to the longest, cut after.
    padded = torch.zeros((max(dims),) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                         device=_wire_device(group, tensor))
    padded[: tensor.shape[0]] = tensor.detach()
    pieces = [torch.empty_like(padded) for _ in dims]
    work = dist.all_gather(pieces, padded, group=group, async_op=True)
    finish = lambda: torch.cat([p[:n] for p, n in zip(pieces, dims)]).to(tensor.device)  # noqa: E731
    return Handle([work], finish), dims


def allgather_async(tensor: Tensor, name: Optional[str] = None, process_set: Any = global_process_set) -> Handle:
    """Start :func:`allgather`; :func:`synchronize` returns the concatenation.

    Args: as :func:`allgather`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    _check_process_set(process_set)
    return _start_allgather(tensor)[0]


class _AllgatherFunction(torch.autograd.Function):
    """Differentiable allgather: each rank's gradient is its rows of the summed gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        handle, dims = _start_allgather(tensor)
        ctx.offset = sum(dims[: rank()])
        ctx.rows = tensor.shape[0]
        return handle.wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        summed = _start_allreduce(grad, torch.empty_like(grad), _SUM, NoneCompressor).wait()
        return summed.narrow(0, ctx.offset, ctx.rows)


def allgather(tensor: Tensor, name: Optional[str] = None, process_set: Any = global_process_set) -> Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others and the dtype may
    not. Differentiable: each rank's gradient is its rows of the summed gradient.

    Args:
        tensor: the tensor to gather (at least one dimension); not modified.
        name: ignored (torch.distributed matches collectives by call order).
        process_set: only ``hvd.global_process_set``.

    Returns:
        The concatenation, with the sum of every rank's first dimension as its first dimension.

    Raises:
        ValueError: if dimensions other than the first, or dtypes, differ between ranks.
    """
    _check_process_set(process_set)
    return _AllgatherFunction.apply(tensor)


# ====================================================================== broadcast


def _check_root(root_rank: Any) -> int:
    world = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ValueError(f"root_rank must be a rank of the job (0..{world - 1}), got {root_rank!r}")
    return root_rank


def _start_broadcast(tensor: Tensor, out: Tensor, root_rank: int) -> Handle:
    """Broadcast the root's ``tensor`` into ``out`` (which may be ``tensor`` itself) asynchronously."""
    root = _check_root(root_rank)
    group = _world()
    with torch.no_grad():
        wire = _on_wire(tensor.detach(), group, fresh=out is not tensor)
    work = None
    if group is not None and collectives.get_world_size(group) > 1:
        work = dist.broadcast(wire, src=root, group=group, async_op=True)

    def finish() -> Tensor:
        if wire.data_ptr() != out.data_ptr():
            with torch.no_grad():
                out.copy_(wire)
        return out

    return Handle([work], finish)


def broadcast_async(tensor: Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start :func:`broadcast`; :func:`synchronize` returns the new tensor.

    Args: as :func:`broadcast`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    _check_process_set(process_set)
    return _start_broadcast(tensor, torch.empty_like(tensor), root_rank)


def broadcast_async_(tensor: Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start :func:`broadcast_`; :func:`synchronize` returns ``tensor``.

    Args: as :func:`broadcast`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    _check_process_set(process_set)
    return _start_broadcast(tensor, tensor, root_rank)


class _BroadcastFunction(torch.autograd.Function):
    """Differentiable broadcast: the root's gradient is the sum of all ranks', the others' zero."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, root_rank: int) -> Tensor:
        ctx.root_rank = root_rank
        return _start_broadcast(tensor, torch.empty_like(tensor), root_rank).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        summed = _start_allreduce(grad, torch.empty_like(grad), _SUM, NoneCompressor).wait()
        if rank() != ctx.root_rank:
            summed.zero_()
        return summed, None


def broadcast(tensor: Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = global_process_set) -> Tensor:
    """The root's ``tensor`` on every rank, as a new tensor; the input is not modified.

    Differentiable: the root's gradient is the sum of every rank's, the others' zero.

    Args:
        tensor: same shape and dtype on every rank.
        root_rank: the rank whose value is sent.
        name: ignored (torch.distributed matches collectives by call order).
        process_set: only ``hvd.global_process_set``.

    Returns:
        A new tensor holding the root's value.

    Raises:
        ValueError: if ``root_rank`` is not a rank of the job.
    """
    _check_process_set(process_set)
    return _BroadcastFunction.apply(tensor, root_rank)


def broadcast_(tensor: Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = global_process_set) -> Tensor:
    """In-place :func:`broadcast` (parameters that require grad included).

    Args: as :func:`broadcast`.

    Returns:
        ``tensor``, now holding the root's value.
    """
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# ====================================================================== join and barrier


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``; return the rank that arrived last.

    Unlike Horovod, a rank that joined does not take part in the other ranks'
    later all-reduces: give every rank the same number of batches (e.g.
    ``DistributedSampler(drop_last=True)``) so that they all join after the
    same collectives.

    Args:
        device: ignored (Horovod's GPU for the join's zero tensors).

    Returns:
        The rank that called ``join()`` last (by wall clock, so approximate across machines).
    """
    arrived = time.time()
    group = _world()
    if group is None:
        return 0
    times = collectives.all_gather_object(arrived, group=group)
    return max(range(len(times)), key=lambda r: (times[r], r))


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank reaches this call.

    Args:
        process_set: only ``hvd.global_process_set``.
    """
    _check_process_set(process_set)
    collectives.barrier(_world())


# ====================================================================== objects, models, optimizers


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """The root's ``obj`` (any picklable object) on every rank.

    Args:
        obj: the object to send (ignored on other ranks).
        root_rank: the rank whose object is sent.
        name: ignored.
        process_set: only ``hvd.global_process_set``.

    Returns:
        The root's object (on the root, ``obj`` itself).
    """
    _check_process_set(process_set)
    root = _check_root(root_rank)
    return collectives.broadcast_object_list([obj], src=root, group=_world())[0]


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = global_process_set) -> List[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order.

    Args:
        obj: this rank's object.
        name: ignored.
        process_set: only ``hvd.global_process_set``.

    Returns:
        A list with one object per rank.
    """
    _check_process_set(process_set)
    return collectives.all_gather_object(obj, group=_world())


def _tensors_to_broadcast(params: Any) -> List[Tensor]:
    """The tensors of a state dict, named parameters or parameters, in an order all ranks share."""
    if isinstance(params, Mapping):
        pairs: List[Tuple[Any, Any]] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, (Tensor, str, bytes)):
        pairs = [p if isinstance(p, tuple) and len(p) == 2 else (None, p) for p in params]
    else:
        raise ValueError(
            f"invalid params of type: {type(params).__name__}; pass model.state_dict(), "
            "model.named_parameters() or model.parameters()"
        )
    for name, tensor in pairs:
        if not isinstance(tensor, Tensor):
            where = f"entry {name!r}" if name is not None else "an entry"
            raise ValueError(f"params must hold tensors, but {where} is a {type(tensor).__name__}")
    return [tensor for _, tensor in pairs]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's tensors with the root's, in place.

    Args:
        params: ``model.state_dict()`` (parameters and buffers),
            ``model.named_parameters()`` or ``model.parameters()``; a generator is fine.
        root_rank: the rank whose values are sent.

    Raises:
        ValueError: if ``params`` is none of those, or ``root_rank`` is not a rank of the job.
    """
    tensors = _tensors_to_broadcast(params)
    root = _check_root(root_rank)
    group = _world()
    if group is None or collectives.get_world_size(group) == 1 or not tensors:
        return
    with torch.no_grad():
        collectives.broadcast_parameters(tensors, src=root, group=group)


def _to_cpu(obj: Any) -> Any:
    # GPU state pickled on the root would land on the root's GPU on every rank.
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: Optimizer, root_rank: int) -> None:
    """Give every rank the root's optimizer state and hyperparameters (e.g. after the root loaded a checkpoint).

    Unlike Horovod, no optimizer step is taken to create missing state: the
    root's state is sent as it is, so no rank's parameters change and the root's
    optimizer is left untouched. An optimizer without state yet ends up without
    state on every rank. Works for every ``torch.optim`` optimizer, LBFGS included.

    Args:
        optimizer: a ``torch.optim`` optimizer or a :class:`DistributedOptimizer`.
        root_rank: the rank whose state is sent.

    Raises:
        TypeError: if ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: if ``root_rank`` is not a rank of the job, or the parameter
            groups differ from the root's.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = _check_root(root_rank)
    if size() == 1:
        return
    mine = root == rank()
    state = broadcast_object(_to_cpu(optimizer.state_dict()) if mine else None, root)
    if not mine:
        _load_state_exactly(optimizer, state)


def _load_state_exactly(optimizer: Optimizer, state_dict: Dict[str, Any]) -> None:
    """``load_state_dict``, then give each state tensor the root's dtype back.

    ``load_state_dict`` casts floating-point state to the parameter's dtype, so
    e.g. NAdam's float32 ``mu_product`` would become float64 (or bfloat16) here
    but not on the root, and the ranks would drift apart bit by bit.
    """
    optimizer.load_state_dict(state_dict)
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        for param, key in zip(group["params"], saved_group["params"]):
            saved, loaded = state_dict["state"].get(key, {}), optimizer.state.get(param, {})
            for name, value in saved.items():
                if isinstance(value, Tensor) and isinstance(loaded.get(name), Tensor):
                    loaded[name] = loaded[name].to(value.dtype)


# ====================================================================== DistributedOptimizer


def _gradient_reduce_op(op: Any, gradient_predivide_factor: float) -> str:
    """The core's ``reduce_op`` for Horovod's ``op`` and ``gradient_predivide_factor``."""
    if op == Adasum:
        raise NotImplementedError(_ADASUM_ADVICE)
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum to combine gradients, got {op!r}")
    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    # Dividing by f before the sum and by size/f after is the mean, which the core
    # computes directly (dividing before any 16-bit cast).
    return "mean" if op == Average else "sum"


def _wire_compression(compression: Any) -> Optional[str]:
    if compression is None:
        return None
    cls = _compressor_class(compression)
    if cls not in (NoneCompressor, FP16Compressor, BF16Compressor):
        raise TypeError(
            f"compression={cls.__name__} is not supported by hvd.DistributedOptimizer: distopt casts whole "
            "packs on the wire itself; use hvd.Compression.none, hvd.Compression.fp16 or hvd.Compression.bf16"
        )
    return cls.wire


def _check_groups(num_groups: Any, groups: Any) -> None:
    # Horovod's explicit fusion groups; distopt packs gradients by size (pack_threshold) instead.
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative integer, got {num_groups!r}")
    if num_groups:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed; distopt ignores both "
            "and packs gradients by size",
            DeprecationWarning,
            stacklevel=3,
        )
    if groups is None:
        return
    if isinstance(groups, bool) or not (
        (isinstance(groups, int) and groups >= 0)
        or (isinstance(groups, list) and all(isinstance(g, (list, tuple)) for g in groups))
    ):
        raise ValueError(f"groups should be a non-negative integer or a list of list of torch.Tensor, got {groups!r}")


def _check_named_parameters(named_parameters: Any, optimizer: Optimizer) -> List[Tuple[str, Tensor]]:
    """Horovod's checks, with the unnamed parameters located; one name per parameter."""
    pairs = list(named_parameters)
    if any(not isinstance(p, tuple) for p in pairs):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()."
        )
    names = [name for name, _ in pairs]
    duplicates = sorted({str(n) for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    named_ids = {id(p) for _, p in pairs}
    unnamed = [
        f"param_groups[{g}]['params'][{j}] (shape {list(p.shape)})"
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
        if id(p) not in named_ids
    ]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but one or more model parameters were not named: "
            f"{', '.join(unnamed[:5])}{' ...' if len(unnamed) > 5 else ''}; pass the named_parameters() "
            "of the model whose parameters the optimizer holds"
        )
    # Horovod lets one tensor appear under two names (tied weights); the first name is kept.
    seen: Dict[int, str] = {}
    return [(name, p) for name, p in pairs if seen.setdefault(id(p), name) == name]


class DistributedOptimizer(_CoreDistributedOptimizer):
    """Horovod's ``hvd.DistributedOptimizer``: distopt's optimizer under Horovod's signature.

    Gradients are averaged (or summed) over all ranks during ``backward()``, in
    packs that overlap the rest of the backward pass; ``step()`` finishes any
    reduction still due and applies the inner optimizer. Also everything of
    :class:`distopt.DistributedOptimizer` (``no_sync()``, ``stats``, ...).

    Differences from Horovod: the object wraps ``optimizer`` rather than being
    an instance of its class (``opt.optimizer`` is the inner one); it keeps the
    inner optimizer's state; parameters are broadcast from rank 0 at
    construction (``hvd.broadcast_parameters`` is still honored);
    ``zero_grad()`` between ``backward()`` and ``step()`` is allowed.

    Args:
        optimizer: the ``torch.optim`` optimizer to wrap.
        named_parameters: ``model.named_parameters()``, to check the names and
            name parameters in errors (default: None).
        compression: ``hvd.Compression.none`` (default), ``hvd.Compression.fp16``
            or ``hvd.Compression.bf16``: 16-bit gradients on the wire.
        backward_passes_per_step: backward passes accumulated locally before the
            gradients are reduced, on the last of them (default: 1).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, Horovod divides by it before the
            sum and by ``size / factor`` after; the result is the same mean, which
            distopt computes directly (default: 1.0).
        num_groups: deprecated in Horovod; accepted and ignored (default: 0).
        groups: Horovod's fusion groups; accepted and ignored, distopt packs
            gradients by size (default: None).
        sparse_as_dense: turn sparse gradients dense instead of raising (default: False).
        process_set: only ``hvd.global_process_set``.

    Raises:
        ValueError: on a bad argument (Horovod's wording), e.g. duplicate or
            missing ``named_parameters``.
        TypeError: if ``optimizer`` is not a ``torch.optim`` optimizer, or
            ``compression`` is not one of ``hvd.Compression``'s.
        NotImplementedError: for ``op=hvd.Adasum`` or another process set.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
        compression: Optional[_CompressorLike] = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Optional[Any] = None,
        sparse_as_dense: bool = False,
        process_set: Any = global_process_set,
    ) -> None:
        _require_init()
        _check_process_set(process_set)
        reduce_op = _gradient_reduce_op(op, gradient_predivide_factor)
        wire = _wire_compression(compression)
        _check_groups(num_groups, groups)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; e.g. "
                "hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))"
            )
        named = None if named_parameters is None else _check_named_parameters(named_parameters, optimizer)
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self._should_synchronize = True  # False inside skip_synchronize()
        self._synchronized = False  # synchronize() ran since the last step()/zero_grad()
        self._skipping_reduction = False  # inside a step() that must not reduce
        super().__init__(
            optimizer,
            reduce_op=reduce_op,
            compression=wire,
            backward_passes_per_step=backward_passes_per_step,
            named_parameters=named,
            sparse_as_dense=sparse_as_dense,
        )

    def synchronize(self) -> None:
        """Finish averaging gradients now, e.g. before clipping or ``GradScaler.unscale_``.

        Then take the step inside :meth:`skip_synchronize`. Also reduces when fewer
        than ``backward_passes_per_step`` passes ran. Never reduces twice.
        """
        if self._skipping_reduction:
            return
        super().synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Context in which ``step()`` does not reduce gradients: use after :meth:`synchronize`.

        Example::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        previous, self._should_synchronize = self._should_synchronize, False
        try:
            yield
        finally:
            self._should_synchronize = previous

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Reduce gradients not reduced yet (unless in :meth:`skip_synchronize`), then step.

        Warns, as Horovod does, when called after :meth:`synchronize` outside
        :meth:`skip_synchronize` (harmless here, costly under Horovod).

        Args:
            closure: re-evaluates the model and returns the loss (default: None).

        Returns:
            Whatever the inner optimizer's ``step`` returns.
        """
        if self._should_synchronize and self._synchronized:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). distopt does not reduce twice, but Horovod does: wrap the step "
                "in `with optimizer.skip_synchronize():` after calling optimizer.synchronize().",
                stacklevel=2,
            )
        self._skipping_reduction = not self._should_synchronize
        try:
            return super().step(closure)
        finally:
            self._skipping_reduction = False
            self._synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and start a new round; safe at any point (distopt waits for reductions).

        Args:
            set_to_none: set ``.grad`` to None instead of zeroing it (default: True).
        """
        super().zero_grad(set_to_none)
        self._synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before gradients are reduced.

        Call it between ``step()`` and the next ``backward()``; it counts the
        passes of the round since the last ``step()`` or ``zero_grad()``.

        Args:
            passes: backward passes per ``step()``, at least 1.

        Raises:
            ValueError: if ``passes`` is not an int >= 1.
        """
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1 (1 reduces after every backward), got {passes!r}"
            )
        self.backward_passes_per_step = passes


# ====================================================================== what is not provided


_UNSUPPORTED = {
    "alltoall": "use torch.distributed.all_to_all_single",
    "alltoall_async": "use torch.distributed.all_to_all_single(..., async_op=True)",
    "reducescatter": "use torch.distributed.reduce_scatter_tensor",
    "reducescatter_async": "use torch.distributed.reduce_scatter_tensor(..., async_op=True)",
    "grouped_reducescatter": "use torch.distributed.reduce_scatter_tensor per tensor",
    "sparse_allreduce_async": "pass sparse_as_dense=True to hvd.DistributedOptimizer",
    "SyncBatchNorm": "use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
    "elastic": "use torchrun --nnodes MIN:MAX --max-restarts N and resume from a checkpoint",
    "start_timeline": "use torch.profiler",
    "stop_timeline": "use torch.profiler",
    "ddl_built": "distopt runs on torch.distributed (gloo/NCCL)",
    "ccl_built": "distopt runs on torch.distributed (gloo/NCCL)",
}


def __getattr__(name: str) -> Any:
    if name in _UNSUPPORTED:
        raise AttributeError(f"distopt.horovod does not provide hvd.{name}: {_UNSUPPORTED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
