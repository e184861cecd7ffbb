"""``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``, ``hvd.broadcast_object``, ``hvd.allgather_object``.

Thin wrappers over :mod:`distopt.collectives` that keep Horovod's signatures,
argument checks and wording. Objects travel serialized by cloudpickle when it is
installed, as Horovod's do (lambdas and local functions included), else by pickle.
"""
from __future__ import annotations

import pickle
from typing import Any, Iterable, List, Mapping, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import collectives
from ..collectives.objects import Dumps, all_gather_serialized, broadcast_serialized
from .errors import internal_errors
from .process_sets import global_process_set, group_of
from .session import check_root, world_group

__all__ = [
    "broadcast_object",
    "allgather_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
]


def _serializer() -> Tuple[Dumps, str]:
    """Horovod's serializer, cloudpickle, when importable (looked up per call); else pickle, and what to do."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps, ("pip install cloudpickle (Horovod's serializer, which distopt.horovod uses when "
                              "installed) to send lambdas and local functions; pickle cannot")
    return cloudpickle.dumps, "send no open files, locks, sockets or generators (cloudpickle cannot serialize them)"


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """The root's ``obj`` on every rank, serialized by cloudpickle (Horovod's) when installed, else pickle.

    Args:
        obj: the object to send (ignored on other ranks).
        root_rank: the rank whose object is sent.
        name: ignored.
        process_set: the ranks taking part (default: all).

    Returns:
        The root's object (on the root, ``obj`` itself).

    Raises:
        TypeError: the root's object cannot be serialized: on every rank, as nothing is sent
            (Horovod's other ranks would wait for it).
        HorovodInternalError: the broadcast failed.
    """
    group = group_of(process_set)
    root = check_root(root_rank)
    src = _in_group(root, group)
    if group is None or dist.get_world_size(group) == 1:
        return obj
    dumps, hint = _serializer()
    with internal_errors():
        return broadcast_serialized([obj], src, group, dumps, "broadcast_object", hint, item="obj")[0]


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = global_process_set) -> List[Any]:
    """Every rank's ``obj``, in rank order, serialized by cloudpickle (Horovod's) when installed, else pickle.

    Args:
        obj: this rank's object.
        name: ignored.
        process_set: the ranks taking part (default: all).

    Returns:
        A list with one object per rank.

    Raises:
        TypeError: a rank's object cannot be serialized: on every rank, as nothing is exchanged.
        HorovodInternalError: the gather failed.
    """
    group = group_of(process_set)
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    dumps, hint = _serializer()
    with internal_errors():
        return all_gather_serialized(obj, group, dumps, "allgather_object", hint)


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
        HorovodInternalError: the broadcast failed.
    """
    tensors = _tensors_to_broadcast(params)
    root = check_root(root_rank)
    group = world_group()
    with internal_errors():
        collectives.broadcast_parameters(tensors, src=root, group=group)


def _sparse_parameters(model: Optional[nn.Module]) -> Set[int]:
    """The ids of the parameters of ``model``'s sparse embeddings (whose gradients are sparse)."""
    if model is None:
        return set()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (to find its sparse embeddings) or None, "
                        f"got {type(model).__name__}; pass the model the optimizer trains")
    return {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
            for p in m.parameters()}


def broadcast_optimizer_state(optimizer: Optimizer, root_rank: int, model: Optional[nn.Module] = None) -> None:
    """Give every rank the root's optimizer state and hyperparameters (e.g. after the root loaded a checkpoint).

    Unlike Horovod, no optimizer step is taken to create missing state: the
    root's state is sent as it is, so no rank's parameters change and the root's
    optimizer is left untouched. An optimizer without state yet ends up without
    state on every rank; as after Horovod's initializing step, its parameters that
    require a gradient and have none get a zero gradient: sparse (as backward makes
    them) for the parameters of ``model``'s sparse ``Embedding``/``EmbeddingBag``
    modules and for every parameter of a ``SparseAdam``, dense for the others, so the
    next backward accumulates into the layout the optimizer expects. Works for every
    ``torch.optim`` optimizer, LBFGS included.
    Each state tensor keeps the root's dtype; see
    :func:`distopt.collectives.broadcast_optimizer_state`, which this calls.

    Args:
        optimizer: a ``torch.optim`` optimizer or a :class:`DistributedOptimizer`.
        root_rank: the rank whose state is sent.
        model: optional, as Horovod's: the model, to find the parameters with sparse gradients.

    Raises:
        TypeError: if ``optimizer`` is not a ``torch.optim.Optimizer`` or ``model`` not a module.
        ValueError: if ``root_rank`` is not a rank of the job, or the parameter
            groups differ from the root's.
        HorovodInternalError: the broadcast failed.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = check_root(root_rank)
    sparse = _sparse_parameters(model)
    inner = getattr(optimizer, "optimizer", optimizer)
    if not inner.state:  # Horovod's users may read .grad right after; Horovod's zero-gradient step made one
        all_sparse = isinstance(inner, torch.optim.SparseAdam)
        with torch.no_grad():
            for group in inner.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        zero = torch.zeros_like(p)
                        # Sparse by rows, as an embedding's backward makes them, so the next one adds to it.
                        p.grad = zero.to_sparse(min(1, p.dim())) if all_sparse or id(p) in sparse else zero
    group = world_group()
    with internal_errors():
        collectives.broadcast_optimizer_state(optimizer, src=root, group=group)
