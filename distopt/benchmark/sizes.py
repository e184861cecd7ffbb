"""Byte counts as people write them: ``256K`` in, ``1MiB`` out (binary units throughout)."""
from __future__ import annotations

import re

__all__ = ["parse_size", "format_size"]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kb": 2**10, "kib": 2**10,
    "m": 2**20, "mb": 2**20, "mib": 2**20,
    "g": 2**30, "gb": 2**30, "gib": 2**30,
}


def parse_size(text: str) -> int:
    """Parse a byte count such as ``0``, ``65536``, ``256K``, ``1MiB`` or ``25MB`` (binary units).

    Args:
        text: a non-negative number, optionally fractional, with an optional unit.

    Returns:
        The number of bytes, rounded down.

    Raises:
        ValueError: if ``text`` is not a non-negative number with an optional unit.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"size={text!r} is not a byte count; write e.g. 0, 65536, 256K, 1MiB or 25MB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(nbytes: int) -> str:
    """``1048576 -> '1MiB'``; exact binary multiples print without decimals.

    Args:
        nbytes: a byte count.

    Returns:
        The count in the largest binary unit it reaches (``B`` below 1 KiB).
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"
