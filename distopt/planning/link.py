"""``pack_threshold="auto"``: the pack size that suits the link, from its measured latency and bandwidth (pure).

A round of ``G`` bytes in packs of ``s`` bytes pays the link's latency ``a`` once per
pack, ``(G / s) a``, and leaves the last pack's transfer, ``s / b``, after backward has
ended, where nothing hides it. Their sum is least at ``s = sqrt(G a b)``: on loopback
(tens of microseconds, gigabytes a second) that is megabytes, on a slow link between
sites far less, since there each pack's tail costs most. A compressor that sends a
fraction ``f`` of the bytes makes both costs ``f`` times the bytes it sends, and its
packs grow by ``1 / sqrt(f)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["LinkTiming", "AUTO_MIN", "AUTO_MAX", "fit_link", "choose_threshold"]

#: The smallest and largest pack ``"auto"`` picks.
AUTO_MIN = 64 << 10
AUTO_MAX = 64 << 20


@dataclass(frozen=True)
class LinkTiming:
    """A link as the root measured it: seconds per collective, and bytes a second beyond that."""

    latency: float
    bandwidth: float


def fit_link(small_bytes: int, small_seconds: Sequence[float], large_bytes: int,
             large_seconds: Sequence[float]) -> LinkTiming:
    """Latency and bandwidth from timed all-reduces of two sizes (medians, so one hiccup does not count)."""
    small = _median(small_seconds)
    large = _median(large_seconds)
    extra = max(large - small, 1e-9)
    return LinkTiming(latency=max(small, 1e-7), bandwidth=(large_bytes - small_bytes) / extra)


def choose_threshold(link: LinkTiming, total_bytes: int, wire_fraction: float = 1.0) -> int:
    """The pack size for a round of ``total_bytes`` over ``link``, within [:data:`AUTO_MIN`, :data:`AUTO_MAX`].

    Args:
        link: the link's timing.
        total_bytes: the gradients' bytes.
        wire_fraction: the share of those bytes a compressor puts on the wire. A pack of
            ``s`` bytes then sends ``f s``: the balance is struck in wire bytes,
            ``f s = sqrt(f G a b)``, so compressed packs hold ``1 / sqrt(f)`` times more.
    """
    fraction = min(max(wire_fraction, 1e-6), 1.0)
    best = math.sqrt(max(total_bytes, 1) * link.latency * link.bandwidth / fraction)
    return int(min(max(best, AUTO_MIN), AUTO_MAX))


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no timings to fit the link from")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
