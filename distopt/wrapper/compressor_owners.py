"""Which wrapper each compressor serves: a compressor's state (error feedback) is one wrapper's.

So one compressor object cannot serve two live wrappers: :func:`bind` refuses it, naming
the fix. A wrapper that another took over (retired) gives its compressor back with
:func:`release`; one that was dropped gives it back by being collected.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Tuple

__all__ = ["bind", "release"]

# By id (a user's compressor need not be hashable, e.g. a dataclass): the compressor, held weakly where it
# can be, and its wrapper, held weakly.
_OWNERS: Dict[int, Tuple[Callable[[], Any], "weakref.ReferenceType[Any]"]] = {}


def bind(compressor: Any, owner: Any) -> None:
    """Record that ``compressor`` serves ``owner``.

    Raises:
        ValueError: it already serves another live wrapper that was not retired.
    """
    for key, (held, owner_ref) in list(_OWNERS.items()):  # forget the dead
        if held() is None or owner_ref() is None:
            del _OWNERS[key]
    entry = _OWNERS.get(id(compressor))
    current = None if entry is None or entry[0]() is not compressor else entry[1]()
    if current is not None and current is not owner:
        raise ValueError(
            f"compression={compressor!r} already serves another DistributedOptimizer, and its state (error "
            "feedback) is one wrapper's; give each wrapper a compressor of its own, e.g. "
            f"compression={type(compressor).__name__}(...) in each constructor call"
        )
    try:
        held_now: Callable[[], Any] = weakref.ref(compressor)
    except TypeError:  # a class with __slots__ and no __weakref__: held for the wrapper's life
        held_now = lambda: compressor  # noqa: E731
    _OWNERS[id(compressor)] = (held_now, weakref.ref(owner))


def release(compressor: Any, owner: Any) -> None:
    """``owner`` no longer uses ``compressor`` (it was retired): another wrapper may take it."""
    entry = _OWNERS.get(id(compressor))
    if entry is not None and entry[0]() is compressor and entry[1]() is owner:
        del _OWNERS[id(compressor)]
