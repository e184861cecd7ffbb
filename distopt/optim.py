"""``distopt.optim.<Name>``: every ``torch.optim`` optimizer, data-parallel, by changing one constructor.

``distopt.optim.AdamW(params, lr=1e-3, pack_threshold=...)`` is
``DistributedOptimizer(torch.optim.AdamW(params, lr=1e-3), pack_threshold=...)``:
torch's arguments go to the inner optimizer, :class:`DistributedOptimizer`'s
keyword arguments to the wrapper.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Type

import torch

from .wrapper import DistributedOptimizer

_WRAPPER_KWARGS = tuple(
    name for name in inspect.signature(DistributedOptimizer.__init__).parameters if name not in ("self", "optimizer")
)


def _factory(cls: Type[torch.optim.Optimizer]) -> Callable[..., DistributedOptimizer]:
    def make(*args: Any, **kwargs: Any) -> DistributedOptimizer:
        wrapper_kwargs = {k: kwargs.pop(k) for k in _WRAPPER_KWARGS if k in kwargs}
        return DistributedOptimizer(cls(*args, **kwargs), **wrapper_kwargs)

    make.__name__ = make.__qualname__ = cls.__name__
    make.__module__ = __name__
    make.__doc__ = (
        f"``DistributedOptimizer(torch.optim.{cls.__name__}(*args, **kwargs), **wrapper_kwargs)``.\n\n"
        f"Takes ``torch.optim.{cls.__name__}``'s arguments plus DistributedOptimizer's keyword "
        f"arguments ({', '.join(_WRAPPER_KWARGS)}).\n\n"
        "Returns:\n    DistributedOptimizer: the wrapped optimizer.\n"
    )
    return make


def _optimizer_classes() -> Dict[str, Type[torch.optim.Optimizer]]:
    return {
        name: obj
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer
    }


globals().update({name: _factory(cls) for name, cls in _optimizer_classes().items()})

__all__: List[str] = sorted(_optimizer_classes())
