"""``hvd.reducescatter`` and ``hvd.alltoall`` (and their grouped and asynchronous variants).

``reducescatter`` reduces like :func:`~distopt.horovod.allreduce` (same ops,
scale factors, compression, dtype checks and int16 handling, through the same path) and keeps this
rank's rows: the first dimension split as Horovod splits it, the first
``n % size`` ranks taking one row more. ``alltoall`` sends the ``i``-th block of
rows to rank ``i`` of the set (equal blocks, or ``splits`` rows each) with
``torch.distributed.all_to_all_single``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives
from ..collectives.tensors import comm_dtype as _comm_dtype
from .agreement import agree
from .allgather_ops import start_allgather
from .allreduce_ops import reduction_spec, start_allreduce, wire_device
from .compression import Compression, Compressor, NoneCompressor, compressor_class, CompressorLike
from .process_sets import global_process_set, lane_of
from .reduce_op import Average, ReduceOp, Sum
from .background import Handle, Launched, current_name, grouped, named, start, then

__all__ = [
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "alltoall",
    "alltoall_async",
]


# ====================================================================== reducescatter


def _rows(n: int, size: int, rank: int) -> Tuple[int, int]:
    """(first row, rows) of ``rank``'s share of ``n`` rows, as Horovod splits them."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _start_reducescatter(tensor: Tensor, how: Any, compression: Type[Compressor] = NoneCompressor) -> Handle:
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar; use tensor.view(1)")
    group = how.group
    size = _size(group)
    me = dist.get_rank(group) if group is not None else 0
    first, rows = _rows(tensor.shape[0], size, me)
    reduced = start_allreduce(tensor, torch.empty_like(tensor), how, compression, operation="reducescatter")
    return then(reduced, lambda out: out.narrow(0, first, rows).clone())


class _ReducescatterFunction(torch.autograd.Function):
    """Differentiable reducescatter, with Horovod's rule for the gradient: every rank's output
    gradient, gathered in rank order, times the scale factors (and the set's size for Sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, how: Any, compression: Type[Compressor]) -> Tensor:
        ctx.how = how
        return _start_reducescatter(tensor, how, compression).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        how = ctx.how
        scale = how.prescale * how.postscale
        if how.op is Sum:
            scale *= _size(how.group)
        gathered, _ = start_allgather(grad.contiguous() * scale if scale != 1.0 else grad.contiguous(), how.group)
        return gathered.wait(), None, None


def _reducescatter(tensor: Tensor, how: Any, compression: Type[Compressor]) -> Tensor:
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _ReducescatterFunction.apply(tensor, how, compression)
    return _start_reducescatter(tensor, how, compression).wait()


def reducescatter_async(tensor: Tensor, name: Optional[str] = None, op: ReduceOp = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start :func:`reducescatter`; :func:`synchronize` returns this rank's rows.

    Args: as :func:`reducescatter` (without ``compression``, as Horovod's).

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    how = reduction_spec(op, None, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: _start_reducescatter(tensor, how))


def reducescatter(tensor: Tensor, name: Optional[str] = None, compression: CompressorLike = Compression.none,
                  op: ReduceOp = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Tensor:
    """Reduce ``tensor`` over the ranks and keep this rank's rows of the result.

    Args:
        tensor: the same shape on every rank, at least one dimension.
        name: optional; while an operation of that name is in flight on this rank, another raises
            ``ValueError`` (Horovod's rule). Ranks match collectives by call order, not by name.
        compression: e.g. ``hvd.Compression.fp16`` to send float tensors in 16 bits (as
            :func:`allreduce`, Average divides before the cast); the result keeps the input's dtype.
        op: ``hvd.Average`` (default) or ``hvd.Sum``, ``Min``, ``Max``, ``Product``.
        process_set: the ranks taking part (default: all).
        prescale_factor: multiplies the input before the reduction (default: 1.0).
        postscale_factor: multiplies the result (default: 1.0).

    Returns:
        Rows ``[start, start + rows)`` of the reduction, where the first ``n % size``
        ranks get ``n // size + 1`` rows and the others ``n // size``. Differentiable:
        the input's gradient is every rank's output gradient, gathered in rank order,
        times the scale factors and, for Sum, the set's size (Horovod's rule).

    Raises:
        ValueError: a scalar, or a dtype :func:`allreduce` cannot reduce with ``op``.
        HorovodInternalError: the ranks' shapes, dtypes or devices differ.
    """
    how = reduction_spec(op, None, prescale_factor, postscale_factor, process_set)
    cls = compressor_class(compression)
    return named(name, lambda: _reducescatter(tensor, how, cls))


def grouped_reducescatter_async(tensors: Sequence[Tensor], name: Optional[str] = None,
                                op: ReduceOp = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start :func:`reducescatter` of each tensor; :func:`synchronize` returns the list."""
    how = reduction_spec(op, None, prescale_factor, postscale_factor, process_set)
    return named(name, lambda: grouped([_start_reducescatter(t, how) for t in tensors]))


def grouped_reducescatter(tensors: Sequence[Tensor], name: Optional[str] = None,
                          compression: CompressorLike = Compression.none, op: ReduceOp = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[Tensor]:
    """:func:`reducescatter` of each tensor in ``tensors``, in one call (differentiable like it).

    Args: as :func:`reducescatter`, with a list of tensors.

    Returns:
        This rank's rows of each reduction, in order.
    """
    how = reduction_spec(op, None, prescale_factor, postscale_factor, process_set)
    cls = compressor_class(compression)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return named(name, lambda: [_reducescatter(t, how, cls) for t in tensors])
    return named(name, lambda: grouped([_start_reducescatter(t, how, cls) for t in tensors])).wait()


# ====================================================================== alltoall


def _split_sizes(tensor: Tensor, splits: Any, size: int) -> List[int]:
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or rows % size:
            raise ValueError(
                f"alltoall without splits needs a first dimension divisible by the {size} ranks, got shape "
                f"{list(tensor.shape)}; pass splits= (rows per rank)"
            )
        return [rows // size] * size
    values = [int(v) for v in (splits.tolist() if isinstance(splits, Tensor) else splits)]
    if len(values) != size or any(v < 0 for v in values) or sum(values) != rows:
        raise ValueError(
            f"splits must give {size} non-negative row counts that add up to the first dimension ({rows}), "
            f"got {values}"
        )
    return values


def alltoall_async(tensor: Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start :func:`alltoall`; :func:`synchronize` returns ``(output, received_splits)``.

    As Horovod's: the tuple whether or not ``splits`` was given (:func:`alltoall` itself
    returns the output alone without ``splits``).

    Args: as :func:`alltoall`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    lane = lane_of(process_set)
    return named(name, lambda: _start_alltoall(tensor, splits, lane, counts=True))


def _start_alltoall(tensor: Tensor, splits: Any, group: Optional[dist.ProcessGroup],
                    counts: bool = False) -> Handle:
    """Start the exchange; its result is the rows, with the received counts if ``splits`` or ``counts``.

    The counts are int32, on the device of ``splits`` when it is a tensor (else the CPU), as Horovod's.
    """
    size = _size(group)
    with_counts = counts or splits is not None
    counts_device = splits.device if isinstance(splits, Tensor) else torch.device("cpu")
    if group is None or size == 1:
        send = _split_sizes(tensor, splits, size)
        out = tensor.detach().clone()
        received = torch.tensor(send, dtype=torch.int32, device=counts_device)
        return start(lambda: ([], lambda: (out, received) if with_counts else out), background=False)
    name = current_name()

    def launch() -> Launched:
        agree("alltoall", tensor, group, any_rows=True, name=name)
        # Splits may differ per rank, so they are not announced: a rank whose splits do not fit
        # sends -1 counts instead, so that every rank raises, not only that one.
        try:
            send, problem = _split_sizes(tensor, splits, size), None
        except ValueError as exc:
            send, problem = [-1] * size, exc
        device = wire_device(group, tensor)
        sizes = torch.tensor(send, dtype=torch.int64, device=device)
        incoming = torch.empty_like(sizes)
        dist.all_to_all_single(incoming, sizes, group=group)  # every rank learns what it receives
        recv = incoming.tolist()
        if problem is not None:
            raise problem
        wrong = [r for r, n in enumerate(recv) if n < 0]
        if wrong:
            raise ValueError(
                f"alltoall: the splits (or the first dimension) of rank(s) {wrong} do not fit their tensor, so "
                "no rank exchanged anything; the error on those ranks says what to change"
            )
        wire = tensor.detach().to(device, _comm_dtype(group, tensor.dtype)).contiguous()
        out = torch.empty((sum(recv),) + tuple(tensor.shape[1:]), dtype=wire.dtype, device=device)
        work = dist.all_to_all_single(out, wire, output_split_sizes=recv, input_split_sizes=send, group=group,
                                      async_op=True)

        def finish() -> Union[Tensor, Tuple[Tensor, Tensor]]:
            result = out.to(tensor.device, tensor.dtype)
            return (result, torch.tensor(recv, dtype=torch.int32, device=counts_device)) if with_counts else result

        return [work], finish

    return start(launch, background=True)


def alltoall(tensor: Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: Any = global_process_set) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Send the ``i``-th block of rows of ``tensor`` to rank ``i``; receive one block from each rank.

    Args:
        tensor: the rows to send, blocks in rank order.
        splits: rows per destination rank (a list or 1-D tensor, one per rank of the set),
            or None for equal blocks (default: None).
        name: optional; while an operation of that name is in flight on this rank, another raises
            ``ValueError`` (Horovod's rule). Ranks match collectives by call order, not by name.
        process_set: the ranks taking part (default: all).

    Returns:
        The received rows in rank order; with ``splits``, also the rows received
        from each rank (an int32 tensor), as Horovod returns them.

    Raises:
        ValueError: ``splits`` does not fit the tensor, or (without ``splits``) the first
            dimension does not divide by the number of ranks.
    """
    group = lane_of(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        out, received = named(name, lambda: _AlltoallFunction.apply(tensor, splits, group))
        return out if splits is None else (out, received)
    return named(name, lambda: _start_alltoall(tensor, splits, group)).wait()


class _AlltoallFunction(torch.autograd.Function):
    """Differentiable alltoall, as Horovod's: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, splits: Any, group: Optional[dist.ProcessGroup]) -> Any:
        out, received = _start_alltoall(tensor, splits, group, counts=True).wait()
        ctx.group = group
        ctx.received = received.tolist()
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Any) -> Tuple[Tensor, None, None]:
        back, _ = _start_alltoall(grad.contiguous(), ctx.received, ctx.group).wait()
        return back, None, None


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return collectives.get_world_size(group) if group is not None else 1
