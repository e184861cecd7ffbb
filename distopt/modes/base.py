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

A mode with state of its own (local SGD's last-sync copy and outer optimizer)
also hooks into construction (:meth:`Mode.attach`), checkpoints
(:meth:`Mode.state_dict`, :meth:`Mode.load_state_dict`), ``join()``
(:meth:`Mode.leaving`, :meth:`Mode.broadcast_state`) and ``stats``
(:meth:`Mode.extra_state_bytes`); the defaults do nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

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

    def settings(self) -> Dict[str, Any]:
        """The mode's settings that decide which collectives run; checked to match across ranks."""
        return {}

    def attach(self, owner: "DistributedOptimizer") -> None:
        """Called once the wrapper is built (its parameters tracked and broadcast).

        Args:
            owner: the wrapper.
        """

    def state_dict(self, owner: "DistributedOptimizer", inner: Dict[str, Any]) -> Dict[str, Any]:
        """The wrapper's state dict: the inner optimizer's ``inner``, plus the mode's own state if any.

        Args:
            owner: the wrapper.
            inner: the inner optimizer's state dict.

        Returns:
            What ``owner.state_dict()`` returns.
        """
        return inner

    def load_state_dict(self, owner: "DistributedOptimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Load the mode's own state from ``state_dict``; return what the inner optimizer loads.

        Args:
            owner: the wrapper.
            state_dict: from ``state_dict()`` of a wrapper or of a plain optimizer.

        Returns:
            The inner optimizer's part of ``state_dict``.
        """
        return state_dict

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
        """At the end of a join block whose ranks ended apart: take rank ``src``'s mode state.

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
