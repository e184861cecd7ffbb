"""``hvd.broadcast`` and its in-place and asynchronous variants: the root's tensor on every rank."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives
from .agreement import agree
from .allreduce_ops import on_wire, ReductionSpec, start_allreduce
from .compression import NoneCompressor
from .background import Handle, Launched, current_name, named, start
from .process_sets import global_process_set, lane_of
from .reduce_op import Average
from .session import check_root, rank

__all__ = [
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
]


def _start_broadcast(tensor: Tensor, out: Tensor, root_rank: int, group: Optional[dist.ProcessGroup]) -> Handle:
    """Broadcast the root's ``tensor`` into ``out`` (which may be ``tensor`` itself) asynchronously."""
    distributed = group is not None and collectives.get_world_size(group) > 1
    with torch.no_grad():
        wire = on_wire(tensor.detach(), group, fresh=out is not tensor)

    def finish() -> Tensor:
        if wire.data_ptr() != out.data_ptr():
            with torch.no_grad():
                out.copy_(wire)
        return out

    def root_in_set() -> int:
        root = check_root(root_rank)
        if group is not None and root not in dist.get_process_group_ranks(group):
            raise ValueError(f"root_rank {root} is not in the process set (ranks "
                             f"{dist.get_process_group_ranks(group)}); pass one of its ranks")
        return root

    if not distributed:
        root_in_set()
        return start(lambda: ([], finish), background=False)
    name = current_name()

    def launch() -> Launched:
        agree("broadcast", tensor, group, root_rank, name=name)  # first, so that a root bad on one rank fails on all
        return [dist.broadcast(wire, src=root_in_set(), group=group, async_op=True)], finish

    return start(launch, background=True)


def broadcast_async(tensor: Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start :func:`broadcast`; :func:`synchronize` returns the new tensor.

    Args: as :func:`broadcast`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    lane = lane_of(process_set)
    return named(name, lambda: _start_broadcast(tensor, torch.empty_like(tensor), root_rank, lane))


def broadcast_async_(tensor: Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start :func:`broadcast_`; :func:`synchronize` returns ``tensor``.

    Args: as :func:`broadcast`.

    Returns:
        A handle for :func:`synchronize` and :func:`poll`.
    """
    return named(name, lambda: _start_broadcast(tensor, tensor, root_rank, lane_of(process_set)))


class _BroadcastFunction(torch.autograd.Function):
    """Differentiable broadcast, as Horovod defines it: the root's gradient is the *mean* of all
    ranks' (Horovod's backward averages, like its allreduce's), the others' zero."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, root_rank: int, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.root_rank = root_rank
        ctx.group = group
        return _start_broadcast(tensor, torch.empty_like(tensor), root_rank, group).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        how = ReductionSpec(Average, 1.0, 1.0, ctx.group)
        averaged = start_allreduce(grad, torch.empty_like(grad), how, NoneCompressor).wait()
        if rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None


def broadcast(tensor: Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = global_process_set) -> Tensor:
    """The root's ``tensor`` on every rank, as a new tensor; the input is not modified.

    Differentiable: the root's gradient is the mean of every rank's (Horovod's rule), the others' zero.

    Args:
        tensor: same shape and dtype on every rank.
        root_rank: the rank whose value is sent.
        name: optional; while an operation of that name is in flight on this rank, another raises
            ``ValueError`` (Horovod's rule). Ranks match collectives by call order, not by name.
        process_set: the ranks taking part (default: all); ``root_rank`` is a global rank in it.

    Returns:
        A new tensor holding the root's value.

    Raises:
        ValueError: if ``root_rank`` is not a rank of the job.
    """
    lane = lane_of(process_set)
    return named(name, lambda: _BroadcastFunction.apply(tensor, root_rank, lane))


def broadcast_(tensor: Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = global_process_set) -> Tensor:
    """In-place :func:`broadcast` (parameters that require grad included).

    Args: as :func:`broadcast`.

    Returns:
        ``tensor``, now holding the root's value.
    """
    return broadcast_async_(tensor, root_rank, name, process_set).wait()
