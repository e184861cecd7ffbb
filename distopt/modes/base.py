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
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

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
