"""``distopt.Islands(inside=distopt.ShardedState())``: the inner optimizer's state sharded over each island's ranks.

:class:`~distopt.modes.islands.Islands` holds the :class:`~distopt.modes.sharded.ShardedState` given as
``inside=`` and calls its own methods (step, share, state dicts, drift check) with a view of the wrapper whose
engine, group, rank and world are the island's (:meth:`Islands._inside`): ownership is computed over the
island's ``k`` ranks from the parameter list alone, so rank ``j`` of every island owns the same parameters; the
updated parameters are shared point to point inside the island only, never across. With synchronous training
across, the inside mode steps this rank's shard of the global mean (the sum across ran where the island's round
settled); with local SGD or DiLoCo across, the across mode's inner step is the inside mode's step
(:meth:`distopt.modes.base.ModeContext.step_inner`), and the share is finished before a sync reads the parameters.

With the gradients sharded too (``inside=ShardedState(gradients=True)``, ZeRO-2 inside, as HSDP does it): the
island's round reduce-scatters each pack to its owners in the island, and with synchronous training across each
rank then sums the gradients it owns, and only those, with rank ``j`` of every other island, which owns the same
(:class:`OwnedGradients`): the across link carries this rank's owned bytes, and nothing is gathered back inside
the island, where every other rank's ``.grad`` of those parameters is None.

This module holds what ``Islands`` needs beyond those calls: the check of the ``inside`` argument, what the
wrapper's arguments may not be with it, the sum across of the owned gradients, and the state-dict plumbing
between the inside mode and the across mode.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..engine import GradientEngine
from ..engine.packs import Pack, release, send_in_place
from . import shards
from .base import Mode, ModeContext
from .sharded import ShardedState
from .synchronous import Synchronous

__all__ = ["OPTIMIZER_KEYS", "OwnedGradients", "inside_mode", "check_compatible", "load", "drop_foreign_state"]

#: The keys of a (sharded) optimizer state dict that the inside mode loads; the rest is the across mode's.
OPTIMIZER_KEYS = ("state", "param_groups", shards.SHARD_KEY)


def inside_mode(inside: Any) -> Optional[ShardedState]:
    """The mode inside each island, from ``Islands(inside=...)``: None for plain replicas (None, the default, or
    ``distopt.Synchronous()``, its explicit spelling), or the ``ShardedState`` given.

    Raises:
        TypeError: ``inside`` is not a distopt mode object.
        ValueError: a mode other than ``ShardedState`` or ``Synchronous``.
    """
    fix = ("pass inside=distopt.ShardedState() (or ShardedState(share='background')) to shard the optimizer state "
           "over each island's ranks, ShardedState(gradients=True) to shard the gradients too, or leave inside unset "
           "for plain replicas")
    if inside is None or type(inside) is Synchronous:
        return None
    if not isinstance(inside, Mode):
        raise TypeError(f"Islands(inside={inside!r}): inside must be a distopt mode object, got "
                        f"{type(inside).__name__}; {fix}")
    if not isinstance(inside, ShardedState):
        raise ValueError(
            f"Islands(inside={inside!r}): inside an island the ranks run plain replicas or ShardedState; a mode that "
            f"syncs the islands on its own schedule (LocalSGD, DiLoCo) goes in across=; {fix}")
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


class OwnedGradients:
    """``inside=ShardedState(gradients=True)`` with synchronous training across: the gradients this rank owns
    (the island's means, once its round reduce-scattered them), summed over its across group into the global
    means. Rank ``j`` of every island owns the same parameters, so every rank of an across group tracks the same
    on the across engine, in the wrapper's order.

    Args:
        inside: the inside mode, whose ownership (over the island's ranks) says what this rank sums.
    """

    def __init__(self, inside: ShardedState) -> None:
        self.inside = inside
        self.tracked: Set[int] = set()  # id() of the parameters the across engine holds
        self.trainable: Set[int] = set()  # id() of every rank's trainable parameters when they were taken on

    def untracked(self, params: List[Tensor]) -> List[Tensor]:
        """This rank's trainable parameters that the across engine does not hold yet."""
        return [p for p in params if p.requires_grad and self.inside.mine(p) and id(p) not in self.tracked]

    def became_trainable(self, params: List[Tensor]) -> bool:
        """Whether a parameter, whichever rank owns it, became trainable since it was taken on: the same answer
        on every rank, which all refuse it alike."""
        return any(p.requires_grad and id(p) not in self.trainable for p in params)

    def take_on(self, engine: GradientEngine, params: List[Tensor], names: Dict[int, str]) -> None:
        """Have the across engine hold this rank's trainable parameters it lacks (every rank of the across group
        at the same point: at construction, and after ``add_param_group()``)."""
        index = {id(p): i for i, p in enumerate(params)}
        new = self.untracked(params)
        self.trainable.update(id(p) for p in params if p.requires_grad)
        if new:
            engine.track(new, [names.get(id(p), f"parameter {index[id(p)]}") for p in new])
            self.tracked.update(id(p) for p in new)

    def cross(self, engine: GradientEngine, scale: Optional[float]) -> None:
        """Sum the owned gradients over the across group, in place: each becomes the global mean. A parameter
        without a gradient on this island is averaged with its zeros where another island has one, and keeps
        ``grad=None`` where no island has."""
        def fill(pack: Pack) -> None:
            pack.absent.clear()
            for j, view in enumerate(pack.views):
                grad = pack.params[j].grad
                if grad is None:
                    view.zero_()
                    pack.absent.append(j)
                    continue
                if pack.direct and grad.is_contiguous():
                    # A pack of its own: the gradient travels from its own storage, summed in place (no copy).
                    send_in_place(pack, grad)
                    view = grad
                else:
                    view.copy_(grad)
                if scale is not None:
                    view.mul_(scale)

        with torch.no_grad():
            if engine.progress is not None:
                engine.progress.phase = "after backward (islands: the owned gradients' sum across the islands)"
            engine.reset_round()  # a round of its own, even where no step came between two (zero_grad, backward)
            engine.launch_exchange(fill)
            engine.finish_exchange()
            for pack in engine.packs:
                flags = pack.flags[: len(pack.params)].tolist()
                for j, view in enumerate(pack.views):
                    p = pack.params[j]
                    if p.grad is not None:
                        if view is not p.grad:
                            p.grad.copy_(view)
                    elif flags[j] > 0:  # another island has a gradient: this one takes the mean with its zeros
                        p.grad = view.clone()
                if pack.direct:  # holds no gradient, nor a scratch buffer, until the next sum
                    release(pack)
