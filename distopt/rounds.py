"""Where a reduction round stands: its states, where it was launched, and what is in flight.

Shared by the engine (:mod:`distopt.engine`, which launches) and the end of a round
(:mod:`distopt.round_end`, which waits and settles).
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from .packs import Pack

__all__ = ["IDLE", "ACTIVE", "DONE", "PHASE_BACKWARD", "PHASE_EXPLICIT", "PHASE_IMPLICIT", "PHASE_EXCHANGE",
           "Sent", "labelled"]

# Round states: gradients accumulate locally (IDLE), the reducing backward is
# running (ACTIVE), gradients are averaged and final (DONE).
IDLE, ACTIVE, DONE = range(3)

# Where a rank launched its packs this round (see :mod:`distopt.control`); an exchange
# (:mod:`distopt.exchange`) is no gradient round, so it raises neither the "during backward"
# nor the "inside step" flag.
PHASE_BACKWARD, PHASE_EXPLICIT, PHASE_IMPLICIT, PHASE_EXCHANGE = range(4)


class Sent(NamedTuple):
    """One collective in flight: an all-reduce, or the all-gather of a gradient's rows."""

    work: Any
    pack: Pack
    index: int  # the pack's place in the plan
    seq: int  # the collective's number on the channel, for the stall inspector
    carries_flags: bool  # False for a direct pack's gradient, whose flags travel apart
    gathered: bool = False  # a direct pack's non-zero rows, gathered (distopt.sparse_rows)


def labelled(name: str) -> Any:
    """A profiler label, only while a profiler runs: otherwise it costs 10-100 µs for nothing."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()
