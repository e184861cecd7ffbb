"""Giving every rank an optimizer's state from rank ``src``, exactly.

The state dict travels pickled (:func:`~.objects.broadcast_object_list`), by
way of the CPU, and each state tensor keeps the sender's dtype.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ._checks import check_rank
from .groups import group_and_size
from .objects import broadcast_object_list

__all__ = ["broadcast_optimizer_state", "cpu_copy"]


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
    group, world_size = group_and_size(group)
    check_rank(src, "src", world_size)
    if group is None or world_size == 1:
        return
    mine = dist.get_rank(group) == src
    payload = [cpu_copy(optimizer.state_dict()) if mine else None]
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


def cpu_copy(obj: Any) -> Any:
    # State pickled on the root's GPU would otherwise land on the root's GPU on every rank.
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj
