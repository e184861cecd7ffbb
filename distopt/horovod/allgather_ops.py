"""``hvd.allgather`` and ``hvd.allgather_async``: every rank's rows, concatenated in rank order (differentiable)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives
from ..collectives.tensors import comm_dtype as _comm_dtype
from .agreement import agree
from .allreduce_ops import ReductionSpec, start_allreduce, wire_device
from .compression import NoneCompressor
from .background import Handle, Launched, current_name, grouped, named, start
from .process_sets import global_process_set, lane_of
from .reduce_op import Average, Sum

__all__ = [
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
]


def start_allgather(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tuple[Handle, List[int]]:
    """Start gathering every rank's rows; also return a list that holds every rank's row count once started."""
    if group is None or collectives.get_world_size(group) == 1:
        if tensor.dim() == 0:
            raise ValueError("allgather needs a tensor with at least one dimension, got a scalar; use tensor.view(1)")
        return start(lambda: ([], lambda: tensor.detach().clone()), background=False), [tensor.shape[0]]
    dims: List[int] = []
    name = current_name()

    def launch() -> Launched:
        # The announcement compares all but the rows, and tells every rank's rows.
        dims.extend(agree("allgather", tensor, group, any_rows=True, name=name))
        if tensor.dim() == 0:  # on every rank: a rank with rows would have failed the agreement
            raise ValueError("allgather needs a tensor with at least one dimension, got a scalar; use tensor.view(1)")
        # all_gather needs one shape: pad every rank's rows to the longest, cut after.
        padded = torch.zeros((max(dims),) + tuple(tensor.shape[1:]), dtype=_comm_dtype(group, tensor.dtype),
                             device=wire_device(group, tensor))
        padded[: tensor.shape[0]] = tensor.detach()
        pieces = [torch.empty_like(padded) for _ in dims]
        work = dist.all_gather(pieces, padded, group=group, async_op=True)
        return [work], lambda: torch.cat([p[:n] for p, n in zip(pieces, dims)]).to(tensor.device, tensor.dtype)

    return start(launch, background=True), dims


def allgather_async(tensor: Tensor, name: Optional[str] = None, process_set: Any = global_process_set) -> Handle:
    """Start :func:`allgather`; :func:`synchronize` returns the concatenation.

    Args: as :func:`allgather`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    lane = lane_of(process_set)
    return named(name, lambda: start_allgather(tensor, lane)[0])


class _AllgatherFunction(torch.autograd.Function):
    """Differentiable allgather, as Horovod defines it: each rank's gradient is its rows of the
    *mean* of the ranks' gradients (Horovod's backward averages)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        handle, dims = start_allgather(tensor, group)
        gathered = handle.wait()  # dims is known once it started
        ctx.group = group
        ctx.offset = sum(dims[: dist.get_rank(group) if group is not None else 0])
        ctx.rows = tensor.shape[0]
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        how = ReductionSpec(Average, 1.0, 1.0, ctx.group)
        averaged = start_allreduce(grad, torch.empty_like(grad), how, NoneCompressor).wait()
        return averaged.narrow(0, ctx.offset, ctx.rows), None


def allgather(tensor: Tensor, name: Optional[str] = None, process_set: Any = global_process_set) -> Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others and the dtype may
    not. Differentiable: each rank's gradient is its rows of the mean gradient (Horovod's rule).

    Args:
        tensor: the tensor to gather (at least one dimension); not modified.
        name: optional; while an operation of that name is in flight on this rank, another raises
            ``ValueError`` (Horovod's rule). Ranks match collectives by call order, not by name.
        process_set: the ranks taking part, in rank order (default: all).

    Returns:
        The concatenation, with the sum of every rank's first dimension as its first dimension.

    Raises:
        RuntimeError: if dimensions other than the first, or dtypes, differ between ranks (on every rank).
    """
    lane = lane_of(process_set)
    return named(name, lambda: _AllgatherFunction.apply(tensor, lane))


def grouped_allgather_async(tensors: Sequence[Tensor], name: Optional[str] = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start :func:`allgather` of each tensor; :func:`synchronize` returns the list of concatenations.

    Args: as :func:`allgather`, with a list of tensors.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    lane = lane_of(process_set)
    return named(name, lambda: grouped([start_allgather(t, lane)[0] for t in tensors]))


def grouped_allgather(tensors: Sequence[Tensor], name: Optional[str] = None,
                      process_set: Any = global_process_set) -> List[Tensor]:
    """:func:`allgather` of each tensor in ``tensors``, in one call.

    Args: as :func:`allgather`, with a list of tensors.

    Returns:
        One concatenation per tensor, in order.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):  # differentiable, one by one
        lane = lane_of(process_set)
        return named(name, lambda: [_AllgatherFunction.apply(t, lane) for t in tensors])
    return grouped_allgather_async(tensors, name, process_set).wait()


def sparse_allreduce_async(tensor: Tensor, name: Optional[str] = None, op: Any = None,
                           process_set: Any = global_process_set) -> Callable[[], Tensor]:
    """Start reducing a sparse tensor by gathering every rank's indices and values.

    Args:
        tensor: a sparse COO tensor of the same size on every rank.
        name: ignored (torch.distributed matches collectives by call order).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: the ranks taking part (default: all).

    Returns:
        A function that waits and returns the reduced sparse tensor (uncoalesced: the
        entries of every rank, summed where they coincide once coalesced), as Horovod's does.

    Raises:
        TypeError: ``tensor`` is not sparse.
        ValueError: ``op`` is neither Average nor Sum.
    """
    if not isinstance(tensor, Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO tensor, got {type(tensor).__name__}; "
                        "for a dense one use hvd.allreduce_async")
    op = Average if op is None else op
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=hvd.Average or hvd.Sum, got {op!r}")
    group = lane_of(process_set)
    sparse = tensor.coalesce()
    indices = start_allgather(sparse.indices().t().contiguous(), group)[0]
    values = start_allgather(sparse.values(), group)[0]
    size = collectives.get_world_size(group) if group is not None else 1

    def result() -> Tensor:
        gathered = values.wait()
        if op is Average:
            gathered = gathered / size
        return torch.sparse_coo_tensor(indices.wait().t(), gathered, tensor.size())

    return result
