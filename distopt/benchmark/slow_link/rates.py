"""Link rates as people and ``tc`` write them: ``200mbit`` in, bits per second out, and back.

Units are ``tc``'s: ``kbit``, ``mbit`` and ``gbit`` are 10**3, 10**6 and 10**9 bits per
second (decimal, as network rates are quoted). ``mbps`` is left out on purpose: to
``tc`` it means megabytes per second, to most people megabits.
"""
from __future__ import annotations

import re

__all__ = ["MIN_RATE", "MAX_RATE", "parse_rate", "format_rate", "rate_slug"]

_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}

#: The slowest rate accepted: below it one step of a 12 MiB model takes many minutes.
MIN_RATE = 100 * 10**3
#: The fastest rate accepted: far beyond what a veth pair carries on any machine.
MAX_RATE = 100 * 10**9


def parse_rate(text: str, argument: str = "--link") -> int:
    """Parse a link rate such as ``200mbit``, ``1gbit``, ``1.5gbit`` or ``500kbit``.

    Args:
        text: a positive number and one of ``kbit``, ``mbit``, ``gbit`` (any case, an
            optional ``/s``).
        argument: how the caller names the value in errors.

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: ``text`` is no rate, or the rate is outside ``[MIN_RATE, MAX_RATE]``.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]bit)(?:/s)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"{argument}={text!r} is not a link rate; write a number and one of kbit, mbit or gbit "
                         "(bits per second, as tc writes them), e.g. 100mbit, 200mbit or 1gbit")
    rate = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"{argument}={text!r} is {format_rate(rate)}; choose a rate from "
                         f"{format_rate(MIN_RATE)} to {format_rate(MAX_RATE)}")
    return rate


def format_rate(bits_per_second: float) -> str:
    """``200_000_000 -> '200 Mbit/s'``, ``1_500_000_000 -> '1.5 Gbit/s'``.

    Args:
        bits_per_second: a rate.

    Returns:
        The rate in the largest decimal unit it reaches, with up to three significant digits.
    """
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.3g} bit/s"


def rate_slug(bits_per_second: int) -> str:
    """A file-name-safe name of a rate, as ``--link`` takes it: ``200_000_000 -> '200mbit'``.

    Args:
        bits_per_second: a rate.

    Returns:
        The rate in the largest unit that divides it exactly (``1500mbit``, not ``1.5gbit``).
    """
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second % scale == 0:
            return f"{bits_per_second // scale}{unit}"
    return f"{bits_per_second}bit"
