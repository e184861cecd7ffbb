"""The ``torch.optim.Optimizer`` surface of a wrapper, forwarded to the optimizer it wraps.

A wrapper holds its inner optimizer as ``self.optimizer`` (composition, never a
dynamic subclass). Param groups, state, defaults, state dicts and hooks are the
inner optimizer's own, so LR schedulers, ``GradScaler`` and checkpoints see one
optimizer, and a state dict saved through the wrapper loads into a plain one.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from torch.optim import Optimizer

__all__ = ["InnerOptimizerSurface"]


class InnerOptimizerSurface(Optimizer):
    """Base of the wrappers: ``torch.optim.Optimizer``'s surface, forwarded to ``self.optimizer``.

    It never calls ``Optimizer.__init__``: the inner optimizer's machinery is the one that runs.

    Example::

        >>> class Wrapper(InnerOptimizerSurface):
        ...     def __init__(self, optimizer):
        ...         self.optimizer = optimizer
        ...     def step(self, closure=None):
        ...         return self.optimizer.step(closure)
    """

    optimizer: Optimizer

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict: loads into a plain optimizer and back."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load an inner-optimizer state dict (from this wrapper or a plain optimizer)."""
        self.optimizer.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Register on the inner optimizer: it runs with averaged gradients."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)
