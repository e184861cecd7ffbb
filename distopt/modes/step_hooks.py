"""Running an optimizer's step hooks around a step that is more than its own ``step()`` call.

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``):
the global pre-hooks and the optimizer's own run before it, its own post-hooks
and the global ones after it. A mode that calls the inner ``step`` on part of
the parameters and does more afterwards (``shard_state=True`` narrows the param
groups to this rank's parameters, then shares the updated parameters) would
have the hooks see the narrowed groups and run before the other ranks'
parameters arrive. :func:`step_with_hooks` runs them around the whole of it
instead, once per step, as torch's wrapper does around an unsharded step.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Optional, Tuple

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

__all__ = ["step_with_hooks"]

#: ``body(step, args, kwargs)``: calls ``step(*args, **kwargs)`` (the unhooked step) once, and
#: returns what the wrapper's ``step()`` returns.
Body = Callable[[Callable[..., Any], Tuple[Any, ...], dict], Any]


def step_with_hooks(optimizer: Optimizer, closure: Optional[Callable[[], Any]], body: Body) -> Any:
    """Run ``body`` between ``optimizer``'s step pre-hooks and post-hooks.

    The hooks get the arguments torch's wrapper would give them for
    ``optimizer.step(closure)``; a pre-hook that returns new ``(args, kwargs)``
    changes what ``body`` passes to the step, as in torch.

    Args:
        optimizer: the inner optimizer.
        closure: the closure for its step, or None.
        body: does the step; gets the unhooked step function and its arguments.

    Raises:
        RuntimeError: a pre-hook returned something other than None or ``(args, kwargs)``.
    """
    args: Tuple[Any, ...] = (optimizer,) if closure is None else (optimizer, closure)
    kwargs: dict = {}
    step = type(optimizer).step
    raw = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if raw is None:  # torch did not wrap this step, so no hook would run around it either
        return body(lambda *a, **k: optimizer.step(*a[1:], **k), args, kwargs)

    def unhooked(*a: Any, **k: Any) -> Any:
        out = raw(*a, **k)
        getattr(optimizer, "_optimizer_step_code", lambda: None)()  # the profiler's marker
        return out

    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for pre_hook in chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                              optimizer._optimizer_step_pre_hooks.values()):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"a step pre-hook of {type(optimizer).__name__} must return None or a tuple of (new_args, "
                        f"new_kwargs), but returned {result!r}"
                    )
                args, kwargs = result
        out = body(unhooked, args, kwargs)
        for post_hook in chain(optimizer._optimizer_step_post_hooks.values(),
                               torch_optimizer._global_optimizer_post_hooks.values()):
            post_hook(optimizer, args, kwargs)
        return out
