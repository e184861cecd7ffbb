"""``hvd.broadcast`` and its in-place and asynchronous variants: the root's tensor on every rank."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives
from .agreement import agree
from .allreduce_ops import _AVERAGE, _on_wire, _start_allreduce
from .basics import _check_root, _world, rank
from .compression import NoneCompressor
from .sync import Handle
from .unsupported import _check_process_set, global_process_set

__all__ = [
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
]


def _start_broadcast(tensor: Tensor, out: Tensor, root_rank: int) -> Handle:
    """Broadcast the root's ``tensor`` into ``out`` (which may be ``tensor`` itself) asynchronously."""
    group = _world()
    distributed = group is not None and collectives.get_world_size(group) > 1
    if distributed:  # before the range check, so that a root given on one rank only fails on every rank
        agree("broadcast", tensor, group, root_rank)
    root = _check_root(root_rank)
    with torch.no_grad():
        wire = _on_wire(tensor.detach(), group, fresh=out is not tensor)
    work = None
    if distributed:
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
    """Differentiable broadcast, as Horovod defines it: the root's gradient is the *mean* of all
    ranks' (Horovod's backward averages, like its allreduce's), the others' zero."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, root_rank: int) -> Tensor:
        ctx.root_rank = root_rank
        return _start_broadcast(tensor, torch.empty_like(tensor), root_rank).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        averaged = _start_allreduce(grad, torch.empty_like(grad), _AVERAGE, NoneCompressor).wait()
        if rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None


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
