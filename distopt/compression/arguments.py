"""Checks of the built-in compressors' constructor arguments, in one style.

A compressor's settings are used deep inside backward (as block sizes, shifts,
seeds), where a float or a string fails with a raw error that names nothing. So
every constructor checks its arguments' types first: a wrong type raises
``TypeError``, a value out of range ``ValueError``, and both name the compressor,
the argument, the value given and what the argument takes.
"""
from __future__ import annotations

import numbers
from typing import Any

__all__ = ["integer", "real", "boolean"]


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {value!r}"


def integer(owner: str, name: str, value: Any, takes: str) -> int:
    """``value`` as an int, if it is an integer (a bool is not).

    Args:
        owner: the compressor's class name; ``name``: the argument's.
        takes: what the argument takes, for the message (e.g. ``"8 or 4"``).

    Raises:
        TypeError: not an integer, e.g. ``8.0``, ``"8"`` or ``True``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}({name}=) must be an int ({takes}), {_got(value)}")
    return int(value)


def real(owner: str, name: str, value: Any, takes: str) -> float:
    """``value`` as a float, if it is a real number (a bool is not).

    Raises:
        TypeError: not a real number, e.g. ``"2"`` or ``None``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}({name}=) must be a number ({takes}), {_got(value)}")
    return float(value)


def boolean(owner: str, name: str, value: Any) -> bool:
    """``value``, if it is True or False.

    Raises:
        TypeError: anything else, e.g. ``1`` or ``"yes"``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}=) must be True or False, got {value!r}")
    return value
