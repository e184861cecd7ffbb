"""``pack_threshold="auto"``: the pack size that suits the link, from its measured latency and bandwidth (pure).

A round of ``G`` bytes in packs of ``s`` bytes pays the link's latency ``a`` once per
pack, ``(G / s) a``, and leaves the last pack's transfer, ``s / b``, after backward has
ended, where nothing hides it. Their sum is least at ``s = sqrt(G a b)``: on loopback
(tens of microseconds, gigabytes a second) that is megabytes, on a slow link between
sites far less, since there each pack's tail costs most. A compressor that sends a
fraction ``f`` of the bytes makes both costs ``f`` times the bytes it sends, and its
packs grow by ``1 / sqrt(f)``.

Robust to noise by construction:

* ``a b`` is the bytes the link moves in one latency, so only the *ratio* of the two
  timings counts: a machine that is slower across the board chooses the same.
* A large all-reduce that is not measurably slower than a small one (less than
  :data:`RESOLUTION` of the small one's time more) is taken to cost that much more,
  so a link too fast to time at this size gets a bounded pack, not the largest.
* The choice is a power of two, and at most a quarter of the gradients' bytes, so
  the first packs travel during backward.

Hence: between two runs whose median timings of each size differ by at most 20%,
the choices are equal or one power of two apart (``tests/unit/test_link.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["LinkTiming", "AUTO_MIN", "AUTO_MAX", "RESOLUTION", "fit_link", "choose_threshold"]

#: The smallest and largest pack ``"auto"`` picks (powers of two).
AUTO_MIN = 64 << 10
AUTO_MAX = 64 << 20
#: The least extra time, as a share of the small all-reduce's, that a large one is taken to cost:
#: below it the difference is lost in the noise of timing collectives.
RESOLUTION = 0.25


@dataclass(frozen=True)
class LinkTiming:
    """A link as the root measured it: seconds per collective, and bytes a second beyond that."""

    latency: float
    bandwidth: float


def fit_link(small_bytes: int, small_seconds: Sequence[float], large_bytes: int,
             large_seconds: Sequence[float]) -> LinkTiming:
    """Latency and bandwidth from timed all-reduces of two sizes (medians, so one hiccup does not count).

    The large ones are taken to cost at least :data:`RESOLUTION` times the small ones' time more,
    so that a difference too small to measure gives a bounded bandwidth rather than an endless one.
    """
    small = max(_median(small_seconds), 1e-7)
    large = _median(large_seconds)
    extra = max(large - small, RESOLUTION * small)
    return LinkTiming(latency=small, bandwidth=(large_bytes - small_bytes) / extra)


def choose_threshold(link: LinkTiming, total_bytes: int, wire_fraction: float = 1.0) -> int:
    """The pack size for a round of ``total_bytes`` over ``link``: the power of two nearest the balance
    ``sqrt(G a b / f)``, within [:data:`AUTO_MIN`, :data:`AUTO_MAX`] and at most a quarter of
    ``total_bytes`` (the largest power of two not above it; never below :data:`AUTO_MIN`).

    Args:
        link: the link's timing.
        total_bytes: the gradients' bytes.
        wire_fraction: the share of those bytes a compressor puts on the wire. A pack of
            ``s`` bytes then sends ``f s``: the balance is struck in wire bytes,
            ``f s = sqrt(f G a b)``, so compressed packs hold ``1 / sqrt(f)`` times more.
    """
    fraction = min(max(wire_fraction, 1e-6), 1.0)
    total = max(total_bytes, 1)
    best = math.sqrt(total * link.latency * link.bandwidth / fraction)
    # Rounded in log space: choices within a factor of sqrt(2) of each other mostly coincide.
    nearest = 1 << max(0, round(math.log2(max(best, 1.0))))
    # A quarter of the gradients at most: one pack as large as the round would all travel after backward.
    quarter = 1 << max(0, (total // 4).bit_length() - 1) if total >= 4 else 1
    return max(AUTO_MIN, min(nearest, AUTO_MAX, quarter))


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no timings to fit the link from")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
