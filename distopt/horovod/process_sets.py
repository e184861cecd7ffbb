"""Horovod's process sets on ``torch.distributed`` groups: collectives over a subset of the ranks.

``hvd.add_process_set(ranks)`` is collective (every rank calls it, in the same
order, as in Horovod) and creates a ``torch.distributed`` group of those ranks;
every ``hvd`` collective takes it as ``process_set=``. A rank outside the set
that calls a collective on it gets a ``ValueError`` before anything is sent.
:data:`global_process_set` is every rank.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist

from . import session

# Horovod's names only; group_of, lane_of, solo_group and forget_all serve the other modules here.
__all__ = [
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
]


class ProcessSet:
    """A subset of the job's ranks that collectives can run on, once added with :func:`add_process_set`.

    Args:
        ranks: the global ranks in the set.

    Raises:
        TypeError: ``ranks`` is not a sequence of ints.

    Example::

        >>> evens = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
        >>> if evens.included():
        ...     total = hvd.allreduce(t, op=hvd.Sum, process_set=evens)
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        if isinstance(ranks, (str, bytes)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                      for r in _as_list(ranks)):
            raise TypeError(f"ProcessSet takes a list of ranks (ints), got {ranks!r}; e.g. hvd.ProcessSet([0, 2])")
        self._ranks = sorted(set(_as_list(ranks)))
        self.process_set_id: Optional[int] = None
        self._group: Any = None
        self._lane: Any = None

    @property
    def ranks(self) -> List[int]:
        """The global ranks in the set, in increasing order."""
        return list(self._ranks)

    def included(self) -> bool:
        """Whether this process is in the set."""
        return session.rank() in self.ranks

    def rank(self) -> int:
        """This process's rank within the set, or -1 if it is not in it."""
        ranks = self.ranks
        return ranks.index(session.rank()) if session.rank() in ranks else -1

    def size(self) -> int:
        """How many ranks the set has."""
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    def __init__(self) -> None:
        self.process_set_id = 0
        self._group = self._lane = None

    @property
    def ranks(self) -> List[int]:
        return list(range(session.size()))

    def __repr__(self) -> str:
        return "hvd.global_process_set"


#: Every rank of the job; the default ``process_set=`` of every collective.
global_process_set: ProcessSet = _GlobalProcessSet()

_added: Dict[int, ProcessSet] = {}
_ids = itertools.count(1)


def add_process_set(process_set: Any) -> ProcessSet:
    """Add a process set; every rank must call it, with the same ranks, in the same order.

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The added set, usable as ``process_set=``.

    Raises:
        ValueError: a rank is out of range, the set is empty or already added, or a set of
            the same ranks exists.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = session.size()
    if not ps.ranks or any(not 0 <= r < world for r in ps.ranks):
        raise ValueError(f"a process set needs ranks in 0..{world - 1}, got {ps.ranks}")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} was added already; use it as it is")
    for other in _added.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} exists already ({other!r}); use that one")
    group = session.world_group()
    # new_group is collective over the whole job, as add_process_set is in Horovod; the second
    # group is the set's lane for tensor collectives (see .background).
    ps._group = dist.new_group(ranks=ps.ranks) if group is not None else None
    ps._lane = dist.new_group(ranks=ps.ranks) if group is not None else None
    ps.process_set_id = next(_ids)
    _added[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove an added process set (every rank must call it); False if it was not added or is global."""
    if not isinstance(process_set, ProcessSet) or process_set is global_process_set:
        return False
    if _added.pop(process_set.process_set_id if process_set.process_set_id is not None else -1, None) is None:
        return False
    if process_set._group is not None and process_set.included():
        dist.destroy_process_group(process_set._group)
        dist.destroy_process_group(process_set._lane)
    process_set._group = process_set._lane = None
    process_set.process_set_id = None
    return True


def group_of(process_set: Any) -> Optional[dist.ProcessGroup]:
    """The group a collective on ``process_set`` runs on (None: a job of one process).

    Raises:
        ValueError: the set was not added, or this rank is not in it.
        TypeError: ``process_set`` is not a process set.
    """
    if process_set is None or process_set is global_process_set:
        return session.world_group()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet (from hvd.add_process_set), got {process_set!r}")
    if process_set.process_set_id not in _added:
        raise ValueError(f"{process_set!r} was not added; call hvd.add_process_set on every rank first")
    if not process_set.included():
        raise ValueError(
            f"rank {session.rank()} is not in {process_set!r}; call collectives on a process set only on its ranks"
        )
    return process_set._group if session.world_group() is not None else None


def lane_of(process_set: Any) -> Optional[dist.ProcessGroup]:
    """The group the tensor collectives on ``process_set`` run on (see :mod:`.background`).

    Raises:
        ValueError, TypeError: as :func:`group_of`.
    """
    group = group_of(process_set)
    if group is None:
        return None
    if process_set is None or process_set is global_process_set:
        return session.world_lane()
    return process_set._lane


_solo: Dict[int, dist.ProcessGroup] = {}


def solo_group() -> dist.ProcessGroup:
    """A group of this rank alone (created by it alone), for work that is local on this rank."""
    me = dist.get_rank()
    if me not in _solo:
        _solo[me] = dist.new_group([me], use_local_synchronization=True)
    return _solo[me]


def forget_all() -> None:
    """At shutdown: the groups go with the job's process group."""
    for ps in _added.values():
        ps._group = ps._lane = None
        ps.process_set_id = None
    _added.clear()
    _solo.clear()


def _as_list(ranks: Any) -> List[Any]:
    try:
        return list(ranks)
    except TypeError:
        return [ranks]
