"""What a reduction round has in flight, and how a small sum travels.

The engine (:mod:`distopt.engine.engine`) launches and waits; this module holds the
record of one collective in flight (:class:`Sent`) and the rule for a small sum:
on CPU every rank's copy travels once, as one broadcast from each rank, and each rank
adds the copies in rank order (:func:`sums_by_gather`, :func:`gather_by_broadcasts`,
:func:`sum_copies`).
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..compression.protocol import Collective, Outcome
from .carrier import Carrier
from .packs import Pack
from ..transport.waiting import completed_failure

__all__ = ["SCATTER_TAG", "SCATTER_PARTS", "SCATTER_PART_BYTES", "scatter_part", "scatter_room", "ScatterInParts",
           "scatter_to_owners", "Sent", "labelled", "GATHER_SUM_MAX_BYTES", "GATHER_COPIES_BUDGET", "sums_by_gather", "plan_gathers",
           "gather_buffer", "gather_by_broadcasts", "broadcast_each", "wait_before", "Broadcasts", "sum_copies",
           "sum_cast_copies"]

#: Bytes every rank may receive (the other ranks' copies) for a CPU sum to be done as one
#: gather (a broadcast from each rank) and a local sum, one pass instead of the all-reduce's
#: two: below it the latency of a pass, not bandwidth, sets the cost (0.2 MiB at 2 ranks:
#: 10-20 % of a step).
GATHER_SUM_MAX_BYTES = 512 << 10
#: Bytes of room for the copies a wrapper keeps from round to round: the first small sums of
#: the plan that fit in it gather, the rest are all-reduced (a small ``pack_threshold`` makes
#: every pack small, and copies of them all would double the gradients' memory).
GATHER_COPIES_BUDGET = 4 << 20


class Sent(NamedTuple):
    """One collective in flight: an all-reduce, or the all-gather of a gradient's rows."""

    work: Any
    pack: Pack
    index: int  # the pack's place in the plan
    seq: int  # the collective's number on the channel, for the stall inspector
    carries_flags: bool  # False for a direct pack's gradient, whose flags travel apart
    gathered: bool = False  # a direct pack's non-zero rows, gathered (distopt.engine.sparse_rows)
    copies: Optional[Tensor] = None  # a small sum done as a gather: the other ranks' copies, to add into ``into``
    into: Optional[Tensor] = None
    codec: Optional[Iterator[Collective]] = None  # a compressed pack's codec, resumed when ``work`` is back
    last: bool = False  # ``work`` is the codec's last collective: resuming it only finishes it
    carrier: Optional[Carrier] = None  # ``work`` also carries the pack's flags: unpack it before resuming the codec
    gathered_into: Optional[Tensor] = None  # with a carrier: the codec's all-gather output, to unpack into
    outcome: Optional[Outcome] = None  # the codec's Round.outcome: filled in from the flags before it resumes

    @property
    def staged(self) -> bool:
        """Whether its codec has a later stage to issue once ``work`` is back."""
        return self.codec is not None and not self.last


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
    the other ranks' copies (``world - 1`` times their bytes) fits ``budget`` in all. Every
    rank holds the same plan, so every rank decides alike.
    """
    used, out = 0, []
    for nbytes, device in sums:
        room = (world - 1) * nbytes
        fits = sums_by_gather(nbytes, world, device) and used + room <= budget
        used += room if fits else 0
        out.append(fits)
    return out


def gather_buffer(pack: Pack, tensor: Tensor, world: int, flags: bool) -> Tensor:
    """Room for the other ranks' copies of ``tensor``, kept on ``pack`` from round to round.

    Args:
        flags: ``tensor`` is the pack's flags, sent beside its gradient (a direct pack's): the two are
            in flight together, so each has room of its own even where they are of one size.
    """
    key = (flags, tensor.numel(), tensor.dtype)
    copies = pack.copies.get(key)
    if copies is None:
        copies = pack.copies[key] = torch.empty((world - 1) * tensor.numel(), dtype=tensor.dtype,
                                                device=tensor.device)
    return copies


def wait_before(work: Any, deadline: Optional[float]) -> Optional[BaseException]:
    """Wait for one transfer's ``work`` until ``deadline`` (``time.monotonic``; None: for as long as it takes).

    Returns:
        None once it is done; or the error it completed with where its wait raised because it failed
        (a peer left, the group timed out) rather than because the time ran out: the caller marks
        itself failed and raises it.

    Raises:
        RuntimeError: the time ran out first.
    """
    try:
        if deadline is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError:
        if not work.is_completed():
            raise  # the time ran out first
        return completed_failure(work)  # else it completed just after the time ran out: failed, or not
    return None


class Broadcasts:
    """The broadcasts of one gather, waited for as one collective's work.

    Args:
        works: one broadcast's work per rank.
    """

    __slots__ = ("works", "failed")

    def __init__(self, works: List[Any]) -> None:
        self.works = works
        self.failed = False

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Wait for every broadcast; raises ``RuntimeError`` as a work does (timeout or failure)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self.works:
            failure = wait_before(work, deadline)
            if failure is not None:
                self.failed = True  # a peer left, or the group timed out
                raise failure
        return True

    def is_completed(self) -> bool:
        """Every broadcast is done, or one failed (its error is the one to explain)."""
        return self.failed or all(work.is_completed() for work in self.works)


def broadcast_each(group: Any, parts: Sequence[Tensor]) -> Broadcasts:
    """Rank ``r``'s ``parts[r]`` to every rank, one broadcast from each rank, side by side.

    An all-gather in broadcasts: gloo's all-gather stages its output in a fresh buffer on
    every call and then copies it out, and those allocations, in the group's own threads,
    grew a two-rank process by 2-3 MiB over a few hundred steps; a broadcast sends and
    receives in place.

    Args:
        group: the process group (its own methods are called, as DDP's reducer does).
        parts: one contiguous tensor per rank of ``group``, alike in shape and dtype: this
            rank's is sent, the others are received into.
    """
    works = []
    for root, part in enumerate(parts):
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        options.asyncOp = True
        works.append(group.broadcast([part], options))
    return Broadcasts(works)


def gather_by_broadcasts(group: Any, others: Tensor, tensor: Tensor, world: int) -> Broadcasts:
    """The other ranks' ``tensor`` into ``others`` (in rank order); this rank sends ``tensor`` where it lies.

    Args:
        group: the process group.
        others: room for ``world - 1`` copies of ``tensor``.
        tensor: this rank's part.
        world: ranks in ``group``.
    """
    rank = group.rank()
    parts = list(others.view(world - 1, -1))
    parts.insert(rank, tensor.view(-1))
    return broadcast_each(group, parts)


#: Tags of the point-to-point transfers of a reduce-scatter (:func:`scatter_to_owners`), above those of the
#: parameter share that may still be in flight on the same group: pack ``k``'s part ``j`` travels under
#: ``SCATTER_TAG + k * SCATTER_PARTS + j``.
SCATTER_TAG = 1 << 24

#: The most parts a chunk of a reduce-scatter is received in.
SCATTER_PARTS = 1 << 10

#: Bytes of a chunk of a reduce-scatter received at once from each other rank: a larger chunk arrives
#: in parts of this size, one after the other, into room for one part per other rank, each part added
#: as it arrives. The room, not the chunk, is what the owner holds besides its gradients (a whole
#: 64 MiB copy for a 64 MiB gradient owned at two ranks, otherwise).
SCATTER_PART_BYTES = 8 << 20


def scatter_part(numel: int, element_size: int) -> int:
    """Elements of each part a chunk of ``numel`` elements is received in (the last may be shorter; pure)."""
    part = max(1, SCATTER_PART_BYTES // element_size, -(-numel // SCATTER_PARTS))
    return min(part, max(numel, 1))


class ScatterInParts:
    """A reduce-scatter in point-to-point transfers, waited for as one collective's work (:func:`scatter_to_owners`).

    Every part this rank sends is posted at once; this rank's own chunk is received part after part:
    part ``j + 1``'s receives are posted once part ``j``'s copies have arrived and been added into the
    chunk, in rank order (:func:`sum_copies`). So only the first part arrives while backward runs; the
    others cross during the wait at its end. Each transfer is waited for once (a gloo send or receive
    counts its completions: a second wait on one that is done waits forever), and the whole may be
    waited for again, or again after a wait that gave up.

    With ``into`` (a cast, ``compression="fp16"``), ``chunks`` are the pack's values in the wire dtype and
    ``room`` is of that dtype too: the copies travel and wait in 16 bits, and ``into``, this rank's chunk in
    the pack's dtype, becomes the sum of every rank's 16-bit contribution, its own included, added in the
    pack's dtype (:func:`sum_cast_copies`).
    """

    __slots__ = ("group", "rank", "world", "tag", "mine", "into", "room", "part", "parts", "done", "receives",
                 "sends", "failed")

    def __init__(self, group: Any, chunks: Sequence[Tensor], room: Tensor, tag: int,
                 into: Optional[Tensor] = None) -> None:
        self.group, self.rank, self.world, self.tag = group, group.rank(), group.size(), tag
        # Written through ``.data``, which has a version counter of its own: the engine tells a gradient changed
        # while a round was pending by its version, and the parts added here are the round's own doing.
        self.mine = chunks[self.rank].data.view(-1)
        self.into = None if into is None else into.data.view(-1)
        self.part = scatter_part(self.mine.numel(), self.mine.element_size())
        self.parts = -(-self.mine.numel() // self.part) if self.mine.numel() else 0
        self.room = room
        self.done = 0  # parts received and added
        self.failed = False
        self.sends: List[Any] = []
        for q in range(self.world):
            theirs = chunks[q].view(-1)
            if q == self.rank or not theirs.numel():
                continue
            step = scatter_part(theirs.numel(), theirs.element_size())
            for j, start in enumerate(range(0, theirs.numel(), step)):
                self.sends.append(group.send([theirs[start:start + step]], q, tag + j))
        self.receives: List[Any] = self._receive(0)

    def _receive(self, j: int) -> List[Any]:
        """Post the receives of part ``j`` of this rank's chunk (none once every part is in)."""
        if j >= self.parts:
            return []
        n = min(self.part, self.mine.numel() - j * self.part)
        copies = self.room[:(self.world - 1) * n].view(self.world - 1, n)
        peers = [q for q in range(self.world) if q != self.rank]
        return [self.group.recv([copies[k]], q, self.tag + j) for k, q in enumerate(peers)]

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Receive and add every part not yet in, then wait for every part sent; raises ``RuntimeError``
        as a work does (timeout or failure), and goes on from there when called again."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while self.done < self.parts or self.sends:
            queue = self.receives if self.done < self.parts else self.sends
            while queue:
                self._wait_one(queue[0], deadline)
                queue.pop(0)
            if self.done < self.parts:
                start = self.done * self.part
                n = min(self.part, self.mine.numel() - start)
                if self.into is None:
                    sum_copies(self.room[:(self.world - 1) * n], self.mine[start:start + n], self.rank, self.world)
                else:
                    sum_cast_copies(self.room[:(self.world - 1) * n], self.mine[start:start + n],
                                    self.into[start:start + n], self.rank, self.world)
                self.done += 1
                self.receives = self._receive(self.done)
        return True

    def _wait_one(self, work: Any, deadline: Optional[float]) -> None:
        failure = wait_before(work, deadline)
        if failure is not None:
            self.failed = True  # a peer left, or the group timed out
            raise failure

    def is_completed(self) -> bool:
        """Every part is in and added and every part sent is done, or a transfer failed."""
        return self.failed or (self.done >= self.parts and not self.sends)


def scatter_to_owners(group: Any, chunks: Sequence[Tensor], room: Tensor, tag: int,
                      into: Optional[Tensor] = None) -> ScatterInParts:
    """A reduce-scatter in point-to-point transfers: rank ``q``'s chunk of this rank's tensor goes to ``q``,
    and the other ranks' copies of this rank's chunk are added into it, in rank order, part by part
    (:class:`ScatterInParts`; done when its wait returns). Each rank sends (N-1)/N of the tensor, each
    part once, to its owner: gloo's reduce-scatter sends an all-reduce's bytes and stages a flat copy of
    its input.

    Args:
        group: the process group.
        chunks: one contiguous chunk per rank of ``group`` (empty where a rank owns nothing).
        room: room for ``world - 1`` copies of one part of this rank's chunk (:func:`scatter_room`).
        tag: the first tag of the transfers, the same on every rank for this tensor.
        into: for a cast (``chunks`` in the wire dtype): this rank's chunk in the pack's dtype, where the sum
            lands; None: in ``chunks[rank]`` itself.
    """
    return ScatterInParts(group, chunks, room, tag, into)


def scatter_room(mine: Tensor, world: int) -> int:
    """Elements of the room :func:`scatter_to_owners` needs for this rank's chunk ``mine`` (pure)."""
    return (world - 1) * scatter_part(mine.numel(), mine.element_size()) if mine.numel() else 0


def sum_copies(others: Tensor, into: Tensor, rank: int, world: int) -> None:
    """``into`` (this rank's part) becomes the sum of every rank's part, added in rank order.

    Every rank makes the same additions of the same values in the same order, so every rank
    gets the same bits; for two ranks these are the all-reduce's values (a + b == b + a).

    Args:
        others: the other ranks' parts, in rank order; spent (the first takes the partial sum).
        into: this rank's part, replaced by the sum.
        rank: this rank.
        world: ranks.
    """
    parts = others.view(world - 1, -1)
    out = into.view(-1)
    if rank > 0:
        before = parts[0]
        for r in range(1, rank):
            before.add_(parts[r])
        torch.add(before, out, out=out)
    for r in range(rank, world - 1):  # parts[r] is rank r + 1's
        out.add_(parts[r])


def sum_cast_copies(others: Tensor, own: Tensor, into: Tensor, rank: int, world: int) -> None:
    """``into`` becomes the sum of every rank's part, each as it travelled (in a 16-bit wire dtype), added in
    rank order in ``into``'s dtype.

    This rank's own contribution is ``own``, its part as the others' parts travelled, not ``into``'s
    unrounded values: every contribution is rounded alike, so the sum depends on the ranks' values and
    not on which rank owns it. Adding in the wider dtype, the sum never rounds to 16 bits, nor overflows
    float16's range where the parts do not.

    Args:
        others: the other ranks' parts, in rank order, in the wire dtype.
        own: this rank's part in the wire dtype.
        into: where the sum lands (this rank's chunk, in the pack's dtype).
        rank: this rank.
        world: ranks.
    """
    parts = others.view(world - 1, -1)
    out = into.view(-1)
    mine = own.view(-1)
    # Rank order whoever owns the chunk: rank 0's part first, into ``out`` itself (no temporary).
    out.copy_(parts[0] if rank > 0 else mine)
    for r in range(1, rank):
        out.add_(parts[r])
    if rank > 0:
        out.add_(mine)
    for r in range(rank, world - 1):  # parts[r] is rank r + 1's
        out.add_(parts[r])


def labelled(name: str) -> Any:
    """A profiler label, only while a profiler runs: otherwise it costs 10-100 µs for nothing."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()
