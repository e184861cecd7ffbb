"""Waiting for collectives: :func:`synchronize` and :func:`poll` on the handle of an ``*_async`` call.

Also the job-wide waits, :func:`join` and :func:`barrier`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch.distributed as dist

from .. import collectives
from ..wrapper.join import join_and_wait
from .agreement import serve_joined
from .background import Handle, start
from .errors import internal_errors
from .optimizer import joining
from .process_sets import global_process_set, group_of, lane_of

__all__ = [
    "synchronize",
    "poll",
    "join",
    "barrier",
]


# ====================================================================== async handles


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its output.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The output tensor (a list of tensors for ``grouped_*``; for ``alltoall_async``, the
        tuple ``(output, received_splits)`` whether or not ``splits`` was given, as Horovod's).

    Raises:
        TypeError: if ``handle`` is not a :class:`Handle`.
        HorovodInternalError: the collective failed (a ``RuntimeError``, as Horovod's).
        ValueError: its arguments could not work on any rank; nothing was sent.
    """
    return _check_handle(handle).wait()


def poll(handle: Handle) -> bool:
    """Whether an asynchronous operation has finished, without blocking.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        True once :func:`synchronize` would not block on communication.

    Raises:
        TypeError: if ``handle`` is not a :class:`Handle`.
    """
    return _check_handle(handle).done()


def _check_handle(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(
            f"handle must be what an hvd.*_async function returned, got {type(handle).__name__}; "
            "for DistributedOptimizer's synchronization call optimizer.synchronize()"
        )
    return handle


# ====================================================================== join and barrier


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``, standing in for the others meanwhile.

    As in Horovod, a rank that has run out of data calls ``join()`` and, until
    every rank has, takes part in the other ranks' work with zeros: in the
    gradient all-reduces of their :class:`~distopt.horovod.DistributedOptimizer`
    (which divide by the full world size; then every rank gets the parameters
    and optimizer state of a rank that ran longest, as in
    :meth:`distopt.DistributedOptimizer.join`), and in their ``hvd.allreduce``
    with op Sum or Average (a metric's average counts the joined ranks' zeros).
    Any other ``hvd`` tensor collective on the global process set while a rank
    has joined raises ``HorovodInternalError`` on every active rank, as Horovod's does.
    Object collectives, collectives on other process sets and :func:`barrier`
    wait for the joined rank: call them after ``join()``.

    The optimizers joined are those built since the last :func:`~distopt.horovod.init`
    and neither closed nor replaced; every rank must hold the same ones. One that
    some rank closed (or dropped) while another still holds it is left out, and once
    every rank has joined, every rank raises the same error naming it.

    Args:
        device: ignored (Horovod's GPU for the join's zero tensors).

    Returns:
        The last rank to join (the same on every rank).

    Raises:
        HorovodInternalError: a collective failed meanwhile, or the ranks hold different
            optimizers (named by their number since ``init()`` and their parameters).
    """
    with internal_errors():
        return _join()


def _join() -> int:
    lane = lane_of(global_process_set)
    if lane is None or dist.get_world_size(lane) == 1:
        return 0
    # The background thread stands in for the others' hvd collectives, after this rank's own
    # submitted ones; this thread meanwhile takes part in their optimizers' rounds.
    served = start(lambda: ([], _constant(serve_joined(lane))), background=True)
    optimizers, described = joining()
    last = join_and_wait(optimizers) if optimizers else None
    last_served = served.wait()
    # Every rank has joined now, so a collective pairs: the same verdict on every rank.
    _check_same_optimizers(collectives.all_gather_object(described, group=dist.group.WORLD))
    return last_served if last is None else last


def _check_same_optimizers(everyone: List[List[Dict[str, Any]]]) -> None:
    """Raise the same error on every rank unless each optimizer joined on every rank of its group."""
    holders: Dict[Tuple[Tuple[int, ...], int], List[int]] = {}
    entries: Dict[Tuple[Tuple[int, ...], int], Dict[str, Any]] = {}
    for rank, described in enumerate(everyone):
        for entry in described:
            key = (tuple(entry["ranks"]), entry["index"])
            entries.setdefault(key, entry)
            holders.setdefault(key, []).append(rank)
    problems = []
    for key, entry in sorted(entries.items()):
        ranks, index = key
        lack = [r for r in ranks if r not in holders[key]]
        if lack:
            over = "" if len(ranks) == len(everyone) else f" over process set {list(ranks)}"
            problems.append(
                f"hvd.DistributedOptimizer #{index} (the {_ordinal(index)} built{over} since hvd.init(); "
                f"{entry['tensors']} parameter tensor{'s' * (entry['tensors'] != 1)}, {entry['elements']} "
                f"elements) is alive on {_ranks(holders[key])} but not on {_ranks(lack)}, where it was closed or "
                "garbage-collected (or never built)")
    if problems:
        raise RuntimeError(
            "hvd.join() needs the same optimizers on every rank, and they differ: " + "; ".join(problems)
            + f". hvd.join() left {'it' if len(problems) == 1 else 'them'} out. Keep each hvd.DistributedOptimizer alive on every rank while any rank "
            "steps it, and close() (or drop) it on every rank alike, before hvd.join()")


def _ordinal(index: int) -> str:
    n = index + 1
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _ranks(ranks: List[int]) -> str:
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _constant(value: Any) -> Any:
    return lambda: value


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank reaches this call.

    Args:
        process_set: the ranks to wait for (default: all).

    Raises:
        HorovodInternalError: the barrier failed (e.g. a rank left).
    """
    group = group_of(process_set)
    with internal_errors():
        collectives.barrier(group)
