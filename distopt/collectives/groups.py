"""Which process group a call runs on, and this process's place in it.

``group=None`` means the default process group: :func:`_resolve_group` is the
one place that turns it into that group, or into None when no process group is
initialized, which every helper in :mod:`distopt.collectives` then treats as a
world of one. Also here: :func:`barrier` and :func:`synchronized`, which wait
for every rank of a group.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional, Tuple, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_dist_info",
    "barrier",
    "synchronized",
    "check_member",
    "group_and_size",
]

_F = TypeVar("_F", bound=Callable[..., Any])


# ---------------------------------------------------------------------------
# who am I


def is_distributed() -> bool:
    """Whether torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _resolve_group(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """The one place where ``group=None`` becomes the default group (or None without one).

    Raises:
        TypeError: ``group`` is neither None nor a ``ProcessGroup``.
    """
    if group is not None:
        if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns on other ranks
            check_member(group)
        if not isinstance(group, ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup (e.g. from dist.new_group(ranks)) or None "
                f"for the default group, got {group!r}"
            )
        return group
    if not is_distributed():
        return None
    return dist.group.WORLD


def group_and_size(group: Optional[ProcessGroup]) -> Tuple[Optional[ProcessGroup], int]:
    """``(group, its world size)`` with ``None`` resolved; ``(None, 1)`` without a process group.

    Raises:
        TypeError: ``group`` is not a process group.
        ValueError: this process is not a member of ``group``.
    """
    group = _resolve_group(group)
    if group is None:
        return None, 1
    check_member(group)
    return group, dist.get_world_size(group)


def check_member(group: ProcessGroup, what: str = "group") -> None:
    """Raise ``ValueError`` if this process is not one of ``group``'s ranks.

    Args:
        group: a process group.
        what: the argument's name, for the message.
    """
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        ranks = "" if not isinstance(group, ProcessGroup) else f", whose ranks are {dist.get_process_group_ranks(group)}"
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {what}{ranks}; run code that uses "
            f"{what} only on its ranks (e.g. `if dist.get_rank() in ranks:`)"
        )


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """Rank of this process in ``group`` (default: the world); 0 without a process group."""
    group = _resolve_group(group)
    return 0 if group is None else dist.get_rank(group)


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of processes in ``group`` (default: the world); 1 without a process group."""
    group = _resolve_group(group)
    return 1 if group is None else dist.get_world_size(group)


def get_local_rank() -> int:
    """Index of this process on its machine; 0 without a process group.

    Read from ``LOCAL_RANK`` (set by :func:`distopt.launch` and torchrun); a
    group set up without it is taken to be on one machine, so the global rank.
    """
    if not is_distributed():
        return 0
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def get_dist_info(group: Optional[ProcessGroup] = None) -> Tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group``."""
    return get_rank(group), get_world_size(group)


# ---------------------------------------------------------------------------
# waiting for every rank


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank of ``group`` reaches this call; a no-op in one process."""
    group, world_size = group_and_size(group)
    if group is not None and world_size > 1:
        dist.barrier(group=group)


def synchronized(fn: Optional[_F] = None, *, group: Optional[ProcessGroup] = None) -> Any:
    """Decorator: after the function returns, wait at a barrier for every rank of ``group``.

    Use it bare (``@synchronized``) or with a group (``@synchronized(group=g)``),
    e.g. around code where rank 0 writes a file the others then read. If the
    function raises, no barrier is entered. A plain call in one process.

    Args:
        fn: the function (given when used bare).
        group: the group to synchronize; default: the world.

    Returns:
        The wrapped function, or a decorator when ``fn`` is not given.
    """
    if fn is None:
        return functools.partial(synchronized, group=group)
    if not callable(fn):
        raise TypeError(f"synchronized decorates a function; got {fn!r}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        barrier(group)
        return result

    return wrapper
