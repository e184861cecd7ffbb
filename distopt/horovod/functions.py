"""``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``, ``hvd.broadcast_object``, ``hvd.allgather_object``.

Thin wrappers over :mod:`distopt.collectives` that keep Horovod's signatures,
argument checks and wording.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from .. import collectives
from .basics import _check_root, _world
from .process_sets import global_process_set, group_of

__all__ = [
    "broadcast_object",
    "allgather_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
]


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """The root's ``obj`` (any picklable object) on every rank.

    Args:
        obj: the object to send (ignored on other ranks).
        root_rank: the rank whose object is sent.
        name: ignored.
        process_set: the ranks taking part (default: all).

    Returns:
        The root's object (on the root, ``obj`` itself).
    """
    group = group_of(process_set)
    root = _check_root(root_rank)
    return collectives.broadcast_object_list([obj], src=_in_group(root, group), group=group)[0]


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = global_process_set) -> List[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order.

    Args:
        obj: this rank's object.
        name: ignored.
        process_set: the ranks taking part (default: all).

    Returns:
        A list with one object per rank.
    """
    return collectives.all_gather_object(obj, group=group_of(process_set))


def _in_group(root: int, group: Any) -> int:
    """``root`` (a global rank) as a rank of ``group``, which it must be in."""
    if group is None:
        return root
    ranks = dist.get_process_group_ranks(group)
    if root not in ranks:
        raise ValueError(f"root_rank {root} is not in the process set (ranks {ranks}); pass one of its ranks")
    return ranks.index(root)


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
    collectives.broadcast_parameters(tensors, src=root, group=_world())


def broadcast_optimizer_state(optimizer: Optimizer, root_rank: int) -> None:
    """Give every rank the root's optimizer state and hyperparameters (e.g. after the root loaded a checkpoint).

    Unlike Horovod, no optimizer step is taken to create missing state: the
    root's state is sent as it is, so no rank's parameters change and the root's
    optimizer is left untouched. An optimizer without state yet ends up without
    state on every rank; as after Horovod's initializing step, its parameters that
    require a gradient and have none get a zero gradient. Works for every
    ``torch.optim`` optimizer, LBFGS included.
    Each state tensor keeps the root's dtype; see
    :func:`distopt.collectives.broadcast_optimizer_state`, which this calls.

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
    inner = getattr(optimizer, "optimizer", optimizer)
    if not inner.state:  # Horovod's users may read .grad right after; Horovod's zero-gradient step made one
        with torch.no_grad():
            for group in inner.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
    collectives.broadcast_optimizer_state(optimizer, src=root, group=_world())
