"""``distopt.Islands(inside=distopt.ShardedState())``: the inner optimizer's state sharded over each island's ranks.

:class:`~distopt.modes.islands.Islands` holds the :class:`~distopt.modes.sharded.ShardedState` given as
``inside=`` and calls its own methods (step, share, state dicts, drift check) with a view of the wrapper whose
engine, group, rank and world are the island's (:meth:`Islands._inside`): ownership is computed over the
island's ``k`` ranks from the parameter list alone, so rank ``j`` of every island owns the same parameters; the
updated parameters are shared point to point inside the island only, never across. With synchronous training
across, the inside mode steps this rank's shard of the global mean (the sum across ran where the island's round
settled); with local SGD or DiLoCo across, the across mode's inner step is the inside mode's step
(:meth:`distopt.modes.base.ModeContext.step_inner`), and the share is finished before a sync reads the parameters.

This module holds what ``Islands`` needs beyond those calls: the check of the ``inside`` argument, what the
wrapper's arguments may not be with it, and the state-dict plumbing between the inside mode and the across mode.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from torch.optim import Optimizer

from . import shards
from .base import Mode, ModeContext
from .sharded import ShardedState
from .synchronous import Synchronous

__all__ = ["OPTIMIZER_KEYS", "inside_mode", "check_compatible", "load", "drop_foreign_state"]

#: The keys of a (sharded) optimizer state dict that the inside mode loads; the rest is the across mode's.
OPTIMIZER_KEYS = ("state", "param_groups", shards.SHARD_KEY)


def inside_mode(inside: Any) -> Optional[ShardedState]:
    """The mode inside each island, from ``Islands(inside=...)``: None for plain replicas (None, the default, or
    ``distopt.Synchronous()``, its explicit spelling), or the ``ShardedState`` given.

    Raises:
        TypeError: ``inside`` is not a distopt mode object.
        ValueError: a mode other than ``ShardedState`` or ``Synchronous``, or ``ShardedState(gradients=True)``.
    """
    fix = ("pass inside=distopt.ShardedState() (or ShardedState(share='background')) to shard the optimizer state "
           "over each island's ranks, or leave inside unset for plain replicas")
    if inside is None or type(inside) is Synchronous:
        return None
    if not isinstance(inside, Mode):
        raise TypeError(f"Islands(inside={inside!r}): inside must be a distopt mode object, got "
                        f"{type(inside).__name__}; {fix}")
    if not isinstance(inside, ShardedState):
        raise ValueError(
            f"Islands(inside={inside!r}): inside an island the ranks run plain replicas or ShardedState; a mode that "
            f"syncs the islands on its own schedule (LocalSGD, DiLoCo) goes in across=; {fix}")
    if inside.gradients:
        # The island's round must leave its mean gradient whole on every rank: the sum across cuts it into
        # slices of its own, and a reduce-scatter to the owners would leave each rank a part.
        raise ValueError(
            f"Islands(inside={inside!r}): the gradients sharded inside an island (ZeRO-2) are not supported yet; "
            "pass inside=distopt.ShardedState() (the optimizer state sharded over the island, ZeRO-1)")
    inside.given_as = f"inside={inside!r}"
    return inside


def check_compatible(inside: ShardedState, *, optimizer: Optimizer, reduce_op: str, bcast_period: int,
                     fault_tolerant: bool, fsdp2: bool) -> None:
    """Refuse what ``inside=ShardedState()`` cannot work with, on every rank before any collective.

    Raises:
        ValueError: FSDP2 parameters (FSDP2 shards the state already), or ``fault_tolerance``.
        TypeError: an optimizer ``ShardedState`` cannot shard (``LBFGS``).
    """
    if fsdp2:
        raise ValueError(
            f"Islands(inside={inside!r}) with FSDP2 parameters (DTensors): FSDP2 shards the optimizer state over the "
            "island already (each rank steps and keeps the state of its own shard of every parameter); drop inside= "
            "(the parameters say that FSDP2 runs inside), or build the model without fully_shard to shard the "
            "optimizer state alone with inside=distopt.ShardedState()")
    if fault_tolerant:
        raise ValueError(
            f"Islands(inside={inside!r}) is not supported yet with fault_tolerance: a rank that heals would need "
            "its shard from rank j of a live island, which the heal does not carry yet; train plain replicas inside "
            "(leave inside unset) under fault_tolerance")
    inside.check_compatible(optimizer=optimizer, reduce_op=reduce_op, bcast_period=bcast_period,
                            fault_tolerant=False)


def load(inside: ShardedState, ctx: ModeContext, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Load the optimizer part of ``state_dict`` (a full state dict, or this rank's own shard, checked) through
    the inside mode, which keeps this rank's shard.

    Args:
        inside: the inside mode; ``ctx``: its view of the wrapper (the island).
        state_dict: what the wrapper was given, without the islands' own key.

    Returns:
        ``state_dict`` without the shard's record, for the across mode's own part.
    """
    inside.load_state_dict(ctx, {k: v for k, v in state_dict.items() if k in OPTIMIZER_KEYS})
    return {k: v for k, v in state_dict.items() if k != shards.SHARD_KEY}


def drop_foreign_state(inside: ShardedState, optimizer: Optimizer) -> None:
    """Keep the optimizer state of this rank's shard only (after the across mode loaded a whole state dict)."""
    for p in list(optimizer.state):
        if not inside.mine(p):
            del optimizer.state[p]
