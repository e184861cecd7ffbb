"""Where a reduction round stands: its states, where it was launched, and what is in flight.

Shared by the engine (:mod:`distopt.engine`, which launches) and the end of a round
(:mod:`distopt.round_end`, which waits and settles), with the rule for a small sum:
on CPU it travels as one all-gather, and each rank adds the copies in rank order
(:func:`sums_by_gather`, :func:`sum_copies`).
"""
from __future__ import annotations

import contextlib
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .packs import Pack

__all__ = ["IDLE", "ACTIVE", "DONE", "PHASE_BACKWARD", "PHASE_EXPLICIT", "PHASE_IMPLICIT", "PHASE_EXCHANGE",
           "Sent", "labelled", "GATHER_SUM_MAX_BYTES", "GATHER_COPIES_BUDGET", "sums_by_gather", "plan_gathers",
           "gather_buffer", "sum_copies"]

#: Bytes every rank may receive (the other ranks' copies) for a CPU sum to be done as one
#: all-gather and a local sum, one ring pass instead of the all-reduce's two: below it the
#: latency of a pass, not bandwidth, sets the cost (0.2 MiB at 2 ranks: 10-20 % of a step).
GATHER_SUM_MAX_BYTES = 512 << 10
#: Bytes of room for the copies a wrapper keeps from round to round: the first small sums of
#: the plan that fit in it gather, the rest are all-reduced (a small ``pack_threshold`` makes
#: every pack small, and copies of them all would double the gradients' memory).
GATHER_COPIES_BUDGET = 4 << 20

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
    copies: Optional[Tensor] = None  # a small sum done as a gather: every rank's copy, to add into ``into``
    into: Optional[Tensor] = None


def sums_by_gather(nbytes: int, world: int, device: torch.device, limit: int = GATHER_SUM_MAX_BYTES) -> bool:
    """Whether a sum of ``nbytes`` over ``world`` ranks is cheaper as an all-gather and a local sum (pure).

    Only on CPU (gloo): NCCL's all-reduce of a small tensor is one kernel already. ``limit``
    bounds the bytes each rank receives (default: :data:`GATHER_SUM_MAX_BYTES`).
    """
    return device.type == "cpu" and world >= 2 and (world - 1) * nbytes <= limit


def plan_gathers(sums: Sequence[Tuple[int, torch.device]], world: int,
                 budget: int = GATHER_COPIES_BUDGET) -> List[bool]:
    """Which of a plan's sums, ``(bytes, device)`` in plan order, travel as a gather (pure).

    Those that :func:`sums_by_gather` allows, first come first served, while the room for
    their copies (``world`` times their bytes) fits ``budget`` in all. Every rank holds the
    same plan, so every rank decides alike.
    """
    used, out = 0, []
    for nbytes, device in sums:
        fits = sums_by_gather(nbytes, world, device) and used + world * nbytes <= budget
        used += world * nbytes if fits else 0
        out.append(fits)
    return out


def gather_buffer(pack: Pack, tensor: Tensor, world: int) -> Tensor:
    """Room for every rank's copy of ``tensor``, kept on ``pack`` from round to round."""
    key = (tensor.numel(), tensor.dtype)
    copies = pack.copies.get(key)
    if copies is None:
        copies = pack.copies[key] = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    return copies


def sum_copies(copies: Tensor, into: Tensor, world: int) -> None:
    """``into`` = the sum of every rank's copy, added in rank order, so every rank gets the same bits.

    For two ranks these are the all-reduce's values (a + b == b + a).
    """
    parts = copies.view(world, -1)
    out = into.view(-1)
    torch.add(parts[0], parts[1], out=out)
    for r in range(2, world):
        out.add_(parts[r])


def labelled(name: str) -> Any:
    """A profiler label, only while a profiler runs: otherwise it costs 10-100 µs for nothing."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()
