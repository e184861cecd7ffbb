"""Row-sparse gradients: a large gradient whose rows are mostly zero sends only its non-zero rows.

An embedding table's gradient is dense in memory but touches only the rows its
batch looked up: 512 of 131,072 rows of a 64 MiB table, say. All-reducing it moves
all 64 MiB; gathering each rank's non-zero rows and their indices moves a few
hundred KiB, and every rank adds them up the same way, in rank order, so every
rank ends with the same values (for two ranks, the very values the all-reduce
gives; only the sign of a zero may differ).

The ranks cannot agree beforehand how many rows each will send, so every rank
sends a fixed *capacity* of rows (padding) with its true count in front, in one
asynchronous gather (a broadcast from each rank, :func:`distopt.engine.in_flight.broadcast_each`)
launched where the all-reduce would have been. If some
rank had more rows than the capacity, every rank sees it in the counts and the
gradient is all-reduced densely instead, that round. The capacity then follows
the largest count (twice it, shrinking when counts fall a lot); a gradient whose
rows, gathered from every rank, would take more than a quarter of its dense bytes
(a dense weight) goes dense. It tries rows again after :data:`RETRY_FIRST` rounds sent
densely, and after twice as many each time it goes dense again (at most
:data:`RETRY_MAX`), so one batch that touched unusually many rows does not cost the
path for the rest of training, while a dense weight pays a try ever more rarely.
Every decision is a function of the gathered counts and of the rounds every rank
sent alike, so the ranks never disagree on the path.

Only CPU gradients take this path: on a GPU, finding the non-zero rows would
block the host until backward had computed the gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["RowSparse", "MIN_ROWS", "MIN_CAP", "BUDGET", "RETRY_FIRST", "RETRY_MAX", "plan_rows", "capacity_after",
           "retry_after", "dense_round", "fill", "settle"]

#: Fewest rows a gradient needs to be worth looking at row by row.
MIN_ROWS = 1024
#: Smallest capacity (rows per rank) once a gradient takes the path.
MIN_CAP = 64
#: Share of the dense gradient's bytes the gathered rows of all ranks may take at most.
BUDGET = 0.25
#: Rounds a gradient that went dense is sent densely before it tries rows again, the first time.
RETRY_FIRST = 16
#: The longest wait between tries (the wait doubles each time the gradient goes dense again).
RETRY_MAX = 4096

_INDEX = 8  # bytes of one row index (int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class RowSparse:
    """How one large gradient travels as rows: its shape as rows, and the current capacity.

    Attributes:
        rows: the gradient's first dimension.
        row_numel: elements per row.
        dtype: the gradient's dtype.
        world: ranks that gather.
        max_cap: the capacity above which sending rows would cost more than :data:`BUDGET` of dense.
        cap: rows each rank sends this round; 0 while the gradient is sent densely.
        first_cap: the capacity a try starts from.
        wait: rounds to send densely before the next try (0 until the gradient first goes dense).
        dense_rounds: rounds sent densely since the gradient last went dense.
        rank: this rank, whose part of ``recv`` is ``send``.
        send: this rank's count, indices and rows (bytes), for ``cap``: its part of ``recv``.
        recv: every rank's ``send``, one after the other.
        mine: this round's non-zero rows of this rank.
    """

    rows: int
    row_numel: int
    dtype: torch.dtype
    world: int
    max_cap: int
    cap: int
    send: Tensor = field(repr=False)
    recv: Tensor = field(repr=False)
    mine: Optional[Tensor] = field(default=None, repr=False)
    first_cap: int = 0
    wait: int = 0
    dense_rounds: int = 0
    rank: int = 0


def _nbytes(cap: int, row_numel: int, itemsize: int) -> int:
    """Bytes one rank sends at capacity ``cap``: count, indices, rows (padded to 8 bytes)."""
    return _INDEX + _INDEX * cap + -(-cap * row_numel * itemsize // 8) * 8


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _buffers(state: RowSparse) -> None:
    n = _nbytes(state.cap, state.row_numel, _itemsize(state.dtype))
    state.recv = torch.zeros(state.world * n, dtype=torch.uint8)
    state.send = state.recv.view(state.world, n)[state.rank]  # sent from where every rank's rows are read


def plan_rows(param: Tensor, world: int, rank: int = 0) -> Optional[RowSparse]:
    """The row-sparse state for ``param``'s gradient on ``rank``, or None where rows cannot pay off.

    Eligible: a CPU floating-point parameter of at least two dimensions and :data:`MIN_ROWS`
    rows, in a world of at least two ranks. Depends only on what every rank agreed on at
    construction (shape, dtype, device, world), so every rank decides alike.
    """
    if world < 2 or param.device.type != "cpu" or param.dtype not in _FLOATS or param.dim() < 2:
        return None
    rows = param.shape[0]
    if rows < MIN_ROWS or rows == 0:
        return None
    row_numel = param.numel() // rows
    row_bytes = row_numel * param.element_size()
    max_cap = min(rows, int(param.numel() * param.element_size() * BUDGET) // (world * (_INDEX + row_bytes)))
    if max_cap < 1:
        return None
    cap = min(max_cap, max(MIN_CAP, rows // 64))
    empty = torch.empty(0, dtype=torch.uint8)
    state = RowSparse(rows, row_numel, param.dtype, world, max_cap, cap, empty, empty, first_cap=cap, rank=rank)
    _buffers(state)
    return state


def capacity_after(cap: int, max_cap: int, largest: int) -> int:
    """The capacity for the next round, given the largest count of this one (pure).

    Returns 0 (dense from now on) when ``largest`` exceeds ``max_cap``; otherwise a
    capacity in ``[largest, max_cap]``: unchanged while ``largest`` fits and is not far
    below it, else twice ``largest`` (at least :data:`MIN_CAP`, at most ``max_cap``).
    """
    if largest > max_cap:
        return 0
    if largest > cap or (4 * largest < cap and cap > MIN_CAP):
        return min(max_cap, max(2 * largest, MIN_CAP))
    return cap


def retry_after(wait: int) -> int:
    """Rounds to send densely before the next try, for a gradient that just went dense (pure).

    Args:
        wait: the previous wait (0 if the gradient never went dense before).
    """
    return RETRY_FIRST if wait <= 0 else min(RETRY_MAX, 2 * wait)


def dense_round(state: RowSparse) -> None:
    """Count one round in which the gradient was sent densely; once the wait is over, the next
    round tries rows again, at the first capacity."""
    state.dense_rounds += 1
    if state.dense_rounds >= state.wait:
        state.cap = state.first_cap
        state.dense_rounds = 0
        _buffers(state)


def _sections(state: RowSparse, buffer: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(count, indices, rows)`` views of one rank's bytes."""
    cap = state.cap
    count = buffer[:_INDEX].view(torch.int64)
    indices = buffer[_INDEX : _INDEX + _INDEX * cap].view(torch.int64)
    start = _INDEX + _INDEX * cap
    end = start + cap * state.row_numel * _itemsize(state.dtype)
    rows = buffer[start:end].view(state.dtype).view(cap, state.row_numel)
    return count, indices, rows


def fill(state: RowSparse, grad: Tensor, scale: Optional[float]) -> Tensor:
    """Write this rank's non-zero rows of ``grad`` (times ``scale``) into ``state.send``; returns it.

    A row counts as non-zero unless all its entries compare equal to zero (NaN and inf
    rows travel). When there are more rows than the capacity, only the count is
    written: every rank will see it and reduce the gradient densely.
    """
    table = grad.view(state.rows, state.row_numel)
    # max and min, unlike a != 0 mask, read the gradient once each without a temporary as large.
    nonzero = table.amax(dim=1) != 0
    nonzero |= table.amin(dim=1) != 0
    mine = nonzero.nonzero().view(-1)
    state.mine = mine
    count, indices, rows = _sections(state, state.send)
    n = mine.numel()
    count.fill_(n)
    if 0 < n <= state.cap:
        indices[:n].copy_(mine)
        torch.index_select(table, 0, mine, out=rows[:n])
        if scale is not None:
            rows[:n].mul_(scale)
    return state.send


def settle(state: RowSparse, grad: Tensor) -> bool:
    """Sum every rank's gathered rows into ``grad``, in rank order; False if some rank overflowed.

    On False ``grad`` is untouched (this rank's own, unscaled gradient), to be reduced
    densely. Either way the capacity moves on (:func:`capacity_after`) and the buffers
    follow it.
    """
    per_rank = state.recv.view(state.world, -1)
    counts: List[int] = per_rank[:, :_INDEX].contiguous().view(torch.int64).view(-1).tolist()
    largest = max(counts)
    fits = largest <= state.cap
    if fits:
        table = grad.view(state.rows, state.row_numel)
        if state.mine is not None and state.mine.numel():
            table.index_fill_(0, state.mine, 0)
        for r, n in enumerate(counts):
            if n:
                _, indices, rows = _sections(state, per_rank[r])
                table.index_add_(0, indices[:n], rows[:n])
    state.mine = None
    cap = capacity_after(state.cap, state.max_cap, largest)
    if cap != state.cap:
        state.cap = cap
        if cap:
            _buffers(state)
        else:
            state.send = state.recv = torch.empty(0, dtype=torch.uint8)
            state.wait = retry_after(state.wait)
    return fits
