"""``hvd.allreduce`` and its in-place, asynchronous and grouped variants (differentiable for Average and Sum).

Also the wire handling the other tensor collectives share: where a tensor must
be for the backend, and when it can be reduced in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives
from ..collectives.tensors import comm_dtype as _comm_dtype
from .agreement import agree
from .compression import Compression, Compressor, NoneCompressor, compressor_class, CompressorLike
from .reduce_op import Average, ReduceOp, Sum, resolve_op, TORCH_OPS
from .background import Handle, Launched, current_name, grouped, named, start
from .process_sets import global_process_set, lane_of

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
]


# ====================================================================== on the wire (allgather and broadcast too)


def wire_device(group: dist.ProcessGroup, tensor: Tensor) -> torch.device:
    # Horovod reduces CPU tensors (metrics) even when it runs on NCCL; NCCL needs them on the GPU.
    if dist.get_backend(group) == "nccl" and tensor.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def on_wire(tensor: Tensor, group: Optional[dist.ProcessGroup], fresh: bool) -> Tensor:
    """A contiguous tensor the backend can send: ``tensor`` itself if possible (unless ``fresh``).

    Dtypes gloo has no kernels for (int16) travel as a wider one, exact for every value;
    copying the result back wraps around as the narrow type does.
    """
    device = tensor.device if group is None else wire_device(group, tensor)
    dtype = tensor.dtype if group is None else _comm_dtype(group, tensor.dtype)
    if tensor.device == device and tensor.dtype == dtype and tensor.is_contiguous() and not fresh:
        return tensor
    return tensor.to(device, dtype, memory_format=torch.contiguous_format, copy=True)


# ====================================================================== allreduce


@dataclass(frozen=True)
class ReductionSpec:
    op: ReduceOp
    prescale: float
    postscale: float
    group: Any  # the process set's lane (see .background); None in a job of one process


# What a reduction can combine, and how: floats and integers with every op; complex numbers
# (as pairs of floats on the wire) only summed; bools only by the logical ops.
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
              torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_COMPLEX = (torch.complex64, torch.complex128)


def _unsupported(operation: str, dtype: torch.dtype, how: ReductionSpec) -> Optional[ValueError]:
    """The error for a dtype ``how`` cannot reduce correctly (Horovod rejects them up front), or None."""
    op = f"op=hvd.{how.op.name.title()}"
    kind = str(dtype).replace("torch.", "")
    if dtype in _COMPLEX:
        if how.op in (Average, Sum):
            return None
        return ValueError(
            f"hvd.{operation} with {op} is not supported for {kind} tensors (complex numbers have no order, "
            "and the product is not elementwise on the wire); use op=hvd.Sum or op=hvd.Average, or reduce "
            "tensor.abs() or torch.view_as_real(tensor)"
        )
    if dtype is torch.bool:
        if how.op in (Average, Sum):
            return ValueError(
                f"hvd.{operation} with {op} is not supported for bool tensors (the sum of bools is their "
                "logical or, not a count); cast first (tensor.int() to count, tensor.float() for the "
                "fraction of ranks), or use op=hvd.Max for any rank, op=hvd.Min for every rank"
            )
        if how.prescale != 1.0 or how.postscale != 1.0:
            return ValueError(
                f"hvd.{operation} of bool tensors takes no scale factors, got prescale_factor={how.prescale!r} "
                f"and postscale_factor={how.postscale!r}; cast the tensor first (tensor.float())"
            )
        return None
    if dtype not in _REDUCIBLE:
        return ValueError(
            f"Tensor type {kind} is not supported by hvd.{operation}; cast it to a supported type first "
            "(float16, bfloat16, float32, float64, uint8, int8, int16, int32, int64; complex for Sum and Average)"
        )
    return None


def start_allreduce(tensor: Tensor, out: Tensor, how: ReductionSpec, compression: Type[Compressor],
                     operation: str = "allreduce") -> Handle:
    """Reduce ``tensor`` into ``out`` (which may be ``tensor`` itself) asynchronously.

    A dtype the reduction cannot handle raises ``ValueError`` from the handle, on every rank
    alike: after the announcement (so ranks whose dtypes differ raise that instead), before any data.
    """
    group = how.group
    world = collectives.get_world_size(group)
    pre, post = how.prescale, how.postscale
    problem = _unsupported(operation, tensor.dtype, how)
    floats = tensor.is_floating_point() or tensor.is_complex()
    if how.op is Average and floats:
        pre /= world  # before the wire, so a 16-bit sum of large values cannot overflow
    wire: Optional[Tensor] = None
    ctx: Any = None
    if problem is None:
        with torch.no_grad():
            source = tensor.detach()
            if pre != 1.0:
                # Integers are scaled in float64 and truncated back on each rank before the sum, as Horovod does.
                source = source * pre if floats else (source.double() * pre).to(source.dtype)
            compressed, ctx = compression.compress(source)
            # The reduction may write into the caller's tensor only when it asked for in place.
            wire = on_wire(compressed, group, fresh=compressed is source and out is not tensor)

    def finish() -> Tensor:
        with torch.no_grad():
            result = compression.decompress(wire, ctx)
            if result.is_floating_point() or result.is_complex():
                if post != 1.0:
                    result = result * post
            elif how.op is Average and post == 1.0:
                result = result.div(world, rounding_mode="trunc")  # exact for every int64
            elif how.op is Average or post != 1.0:
                # Horovod's integer Average is a Sum scaled once by postscale / size, in float64, then
                # truncated once (scaling by postscale after a truncated mean would truncate twice).
                scale = post / world if how.op is Average else post
                result = (result.double() * scale).to(result.dtype)
            if result.data_ptr() != out.data_ptr() or result.shape != out.shape:
                out.copy_(result)
            return out

    if group is None or world == 1:
        def alone() -> Launched:
            if problem is not None:
                raise problem
            return [], finish

        return start(alone, background=False)
    name = current_name()

    def launch() -> Launched:
        summed = TORCH_OPS[how.op] == dist.ReduceOp.SUM and problem is None
        agree(operation, tensor, group, summed=wire if summed else None, name=name,
              reduction=f"{how.op.name.title()} (prescale {how.prescale!r}, postscale {how.postscale!r})")
        if problem is not None:  # every rank has this dtype and op (they agreed): every rank raises
            raise problem
        return [dist.all_reduce(wire, op=TORCH_OPS[how.op], group=group, async_op=True)], finish

    return start(launch, background=True)


def reduction_spec(op: Optional[Any], average: Optional[bool], prescale_factor: float, postscale_factor: float,
               process_set: Any) -> ReductionSpec:
    group = lane_of(process_set)
    return ReductionSpec(resolve_op(op, average), float(prescale_factor), float(postscale_factor), group)


class _AllreduceFunction(torch.autograd.Function):
    """Differentiable allreduce: the gradient is the same reduction of the incoming gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, how: ReductionSpec, compression: Type[Compressor]) -> Tensor:
        ctx.how = how
        ctx.compression = compression
        return start_allreduce(tensor, torch.empty_like(tensor), how, compression).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None]:
        if ctx.how.op not in (Average, Sum):
            raise RuntimeError(
                f"hvd.allreduce(op={ctx.how.op.name.title()}) has no gradient; use op=hvd.Average or op=hvd.Sum "
                "for tensors that need one"
            )
        return start_allreduce(grad, torch.empty_like(grad), ctx.how, ctx.compression).wait(), None, None


def allreduce(
    tensor: Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: CompressorLike = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Tensor:
    """Average (or sum, min, max, multiply) ``tensor`` over all ranks; the input is not modified.

    Differentiable for Average and Sum: the gradient is reduced the same way.

    Integers keep their dtype: scaled in float64 and truncated, as Horovod's (prescale on
    each rank before the sum; for Average, the sum times ``postscale_factor / size``, truncated
    once). Complex tensors take Sum and Average; bool tensors Min, Max and Product.

    Args:
        tensor: the tensor to reduce; same shape and dtype on every rank.
        average: deprecated: True for Average, False for Sum; use ``op``.
        name: optional; while an operation of that name is in flight on this rank, another raises
            ``ValueError`` (Horovod's rule). Ranks match collectives by call order, not by name.
        compression: e.g. ``hvd.Compression.fp16`` to send float tensors in 16 bits.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        prescale_factor: multiplies ``tensor`` before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).

    Returns:
        A new tensor with the reduced value.

    Raises:
        ValueError: if both ``op`` and ``average`` are given, ``op`` is unknown, or the dtype
            cannot be reduced with ``op`` (on every rank, before anything is sent).
        NotImplementedError: for ``hvd.Adasum``.
        HorovodInternalError: the collective failed, e.g. the ranks' shapes differ (on every rank).
    """
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: _AllreduceFunction.apply(tensor, how, compressor_class(compression)))


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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: start_allreduce(tensor, torch.empty_like(tensor), how, NoneCompressor))


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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: start_allreduce(tensor, tensor, how, NoneCompressor))


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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: start_allreduce(tensor, tensor, how, NoneCompressor)).wait()


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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: grouped([start_allreduce(t, torch.empty_like(t), how, NoneCompressor)
                                        for t in tensors]))


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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: grouped([start_allreduce(t, t, how, NoneCompressor) for t in tensors]))


def grouped_allreduce(
    tensors: Sequence[Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: CompressorLike = Compression.none,
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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    cls = compressor_class(compression)
    return named(name, lambda: [_AllreduceFunction.apply(t, how, cls) for t in tensors])


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
    how = reduction_spec(op, average, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: grouped([start_allreduce(t, t, how, NoneCompressor) for t in tensors])).wait()
