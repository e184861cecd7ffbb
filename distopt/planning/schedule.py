"""Streaming local SGD's schedule: which fragment starts its sync, and which applies it, at which step.

Local steps are counted from 1 once local SGD runs (after ``local_warmup``). With
``H`` = ``sync_every``, ``F`` fragments and an overlap of ``tau`` steps:

- fragment ``f`` *launches* (sends its pseudo-gradient) after every local step ``s``
  with ``(s - offset(f)) % H == 0``, where ``offset(f) = (f + 1) * H // F``. The offsets
  are spread evenly over the period and distinct (``F <= H``), so one fragment at a
  time starts its sync, and in every period each fragment syncs once, in the order
  0, 1, ..., F-1. Fragment ``F - 1`` has offset ``H``: with ``F = 1`` the one fragment
  syncs after steps H, 2H, ..., as plain ``sync_every`` does;
- its exchange stays in flight during the next ``tau`` local steps and is *merged*
  (the outer update applied, mixed with the local progress) after local step
  ``s + tau``; with ``tau = 0`` right after it launched. ``tau < H``, so a fragment's
  exchange is merged before the fragment launches again.

Every rank computes the same schedule from its step count, so every rank issues
the same collectives in the same order, whatever its timing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

__all__ = ["StreamSchedule"]


@dataclass(frozen=True)
class StreamSchedule:
    """When each fragment launches and merges (pure).

    Attributes:
        every: local steps between two syncs of a fragment (H, ``sync_every``).
        fragments: fragments (F, 1 <= F <= H).
        overlap: local steps an exchange stays in flight before it is merged (tau, 0 <= tau < H).

    Raises:
        ValueError: the three do not fit together.

    Example::

        schedule = StreamSchedule(every=4, fragments=2, overlap=1)
        schedule.launches(2), schedule.launches(4)    # -> [0], [1]
        schedule.merges(3), schedule.merges(5)        # -> [0], [1]
    """

    every: int
    fragments: int
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or not 1 <= self.fragments <= self.every or not 0 <= self.overlap < self.every:
            raise ValueError(
                f"a streaming schedule needs 1 <= fragments <= every and 0 <= overlap < every, got "
                f"every={self.every}, fragments={self.fragments}, overlap={self.overlap}"
            )

    def offset(self, fragment: int) -> int:
        """The local step, within the first period (1..H), at which ``fragment`` first launches."""
        return (fragment + 1) * self.every // self.fragments

    def launches(self, step: int) -> List[int]:
        """Fragments that launch after local step ``step`` (at most one)."""
        if step < 1:
            return []
        return [f for f in range(self.fragments) if (step - self.offset(f)) % self.every == 0]

    def merges(self, step: int) -> List[int]:
        """Fragments whose exchange is merged after local step ``step``: those launched ``overlap`` steps before."""
        return self.launches(step - self.overlap)

    def last_launch(self, fragment: int, step: int) -> Optional[int]:
        """The last local step ``<= step`` after which ``fragment`` launched, or None if it has not yet."""
        first = self.offset(fragment)
        if step < first:
            return None
        return first + (step - first) // self.every * self.every

    def in_flight(self, step: int) -> List[int]:
        """Fragments launched by local step ``step`` and not merged by it, in launch order."""
        launched = [(s, f) for f in range(self.fragments)
                    for s in [self.last_launch(f, step)] if s is not None and s + self.overlap > step]
        return [f for _, f in sorted(launched)]

    def gap(self) -> int:
        """The fewest local steps between two launches (of any fragments): at most ``overlap`` of them
        keeps one sync in flight at a time."""
        offsets = [self.offset(f) for f in range(self.fragments)]
        return min(b - a for a, b in zip(offsets, offsets[1:] + [offsets[0] + self.every]))

    def order_after(self, step: int) -> List[int]:
        """Every fragment, in the order they next launch after local step ``step``."""
        return sorted(range(self.fragments), key=lambda f: (self.offset(f) - step - 1) % self.every)
