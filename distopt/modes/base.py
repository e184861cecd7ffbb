"""The seam between :class:`distopt.DistributedOptimizer` and the modes that plug into it.

The public class keeps the arguments and the ``torch.optim`` surface; the
:class:`distopt.engine.GradientEngine` under it owns the hooks, the packs and
the reduction round. A mode decides the two things that differ between ways of
training data-parallel:

1. **Gradients at the end of backward** (:attr:`Mode.reduces_in_backward`).
   True: the engine's hooks average every gradient while backward runs, and
   ``.grad`` is final when ``backward()`` returns (synchronous training, and
   sharded optimizer state, which also needs averaged gradients). False: the
   gradients stay local (local SGD, DiLoCo), and the mode communicates in
   :meth:`Mode.step` instead.
2. **What happens at step** (:meth:`Mode.step`). The synchronous mode finishes
   any reduction still due and runs the inner optimizer. Other modes may step
   only the parameters they own and then share them, or average parameters
   every H steps.

After :meth:`Mode.step` returns, the wrapper starts a new round, counts the step
and re-broadcasts parameters when ``bcast_period`` says so; a mode does not.

A mode may also take part in the rest of the wrapper's life: its settings
(:meth:`Mode.settings`, checked across ranks), construction (:meth:`Mode.attach`)
and the parameters it was given (:meth:`Mode.on_track`), ``join()`` (the last
round of a rank that leaves, :meth:`Mode.leaving`; what a rank that has joined does
after each shadow round, :meth:`Mode.shadow_step`; the end of the block,
:meth:`Mode.settle_after_join` and :meth:`Mode.broadcast_state`), checkpoints
(:meth:`Mode.state_dict`, :meth:`Mode.load_state_dict`) and ``stats``
(:meth:`Mode.extra_state_bytes`). The defaults do what synchronous training needs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

from .. import collectives, stalls

if TYPE_CHECKING:  # the wrapper imports the modes, not the other way round
    from ..optimizer import DistributedOptimizer

__all__ = ["Mode"]


class Mode:
    """Base class of the modes: what a wrapper does with gradients and at ``step()``.

    The wrapper holds its mode; the mode gets the wrapper as an argument rather
    than holding it, so that a dropped wrapper is freed at once (no reference
    cycle) and its hooks go quiet.
    """

    #: Whether the engine averages gradients during backward.
    reduces_in_backward: bool = True

    def step(self, owner: "DistributedOptimizer", closure: Optional[Callable[[], Any]]) -> Any:
        """Take one optimizer step; return what the inner optimizer's ``step`` returns.

        Args:
            owner: the wrapper taking the step.
            closure: re-evaluates the model and returns the loss, or None.
        """
        raise NotImplementedError

    def on_track(self, owner: "DistributedOptimizer", params: List[Tensor]) -> None:
        """The wrapper took on ``params`` (at construction or ``add_param_group``), in tracking order."""

    def shadow_step(self, owner: "DistributedOptimizer") -> None:
        """As a rank that has joined (:mod:`distopt.joining`): follow the others' step after a shadow round."""

    def settle_after_join(self, owner: "DistributedOptimizer", last: int, identical: bool) -> None:
        """At the end of a join block: unless the ranks are ``identical`` already (none stopped
        early), give every rank rank ``last``'s parameters and optimizer state."""
        if identical:
            return
        group, progress = owner._group(), owner._engine.progress
        with torch.no_grad(), stalls.inspected(progress, "the parameter broadcast at the end of the join block"):
            collectives.broadcast_parameters(owner._params, src=last, group=group)
        with stalls.inspected(progress, "the optimizer-state broadcast at the end of the join block"):
            collectives.broadcast_optimizer_state(owner.optimizer, src=last, group=group)

    def state_dict(self, owner: "DistributedOptimizer") -> Dict[str, Any]:
        """What ``owner.state_dict()`` returns: the inner optimizer's, by default."""
        return owner.optimizer.state_dict()

    def load_state_dict(self, owner: "DistributedOptimizer", state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (or a plain optimizer's state dict)."""
        owner.optimizer.load_state_dict(state_dict)

    def settings(self) -> Dict[str, Any]:
        """The mode's settings that decide which collectives run; checked to match across ranks."""
        return {}

    def attach(self, owner: "DistributedOptimizer") -> None:
        """Called once the wrapper is built (its parameters tracked and broadcast).

        Args:
            owner: the wrapper.
        """

    def leaving(self, owner: "DistributedOptimizer") -> Optional[Callable[[], None]]:
        """A rank joins (runs out of data): launch its last contributing round, if it owes one.

        Args:
            owner: the wrapper.

        Returns:
            None, or a function that finishes the round launched (``join()`` calls it
            in place of finishing its first shadow round).
        """
        return None

    def broadcast_state(self, owner: "DistributedOptimizer", src: int) -> None:
        """Take rank ``src``'s mode state: at the end of a join block whose ranks ended apart, and in
        ``broadcast_optimizer_state()`` (after only the root loaded a checkpoint).

        Args:
            owner: the wrapper.
            src: rank, in the wrapper's group, whose state every rank takes.
        """

    def extra_state_bytes(self, owner: "DistributedOptimizer") -> int:
        """Bytes the mode holds besides the model and the inner optimizer (for ``stats``).

        Args:
            owner: the wrapper.
        """
        return 0
