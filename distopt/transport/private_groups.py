"""Process groups distopt creates for its own traffic, and tears down in :func:`distopt.shutdown`.

torch.distributed pairs collectives by their order on a group. If a wrapper's
gradient packs shared a group with the user's own collectives (a metric's
all-reduce, a barrier), one rank's pack could pair with another rank's metric
whenever the ranks reach them in a different order, and the job would hang or
abort. Each :class:`distopt.DistributedOptimizer` therefore talks on a private
group with the same ranks, as Horovod keeps a channel of its own.

Nothing outside this module holds such a group: a wrapper holds a
:class:`PrivateGroup` handle and looks the group up per use, so that
:func:`destroy_all` (called by :func:`distopt.shutdown`) really frees every group
and no communication thread outlives the interpreter.
"""
from __future__ import annotations

import itertools
import weakref
from datetime import timedelta
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["PrivateGroup", "create", "destroy_all", "timeout_of", "build_by_members"]

_groups: Dict[int, ProcessGroup] = {}
_keep_until_shutdown: Set[int] = set()
_keys = itertools.count()
#: Groups of this process alone, built only to move torch's count of groups on (:func:`build_by_members`).
_fillers: List[ProcessGroup] = []
#: How many of them one group may need before the clash is taken for one that will not go away.
_MAX_FILLERS = 8


class PrivateGroup:
    """A handle on a private group; :attr:`group` looks it up.

    Args:
        key: its key in the registry.
    """

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key

    @property
    def group(self) -> ProcessGroup:
        """The group.

        Raises:
            RuntimeError: it was destroyed (by :func:`distopt.shutdown` or :meth:`destroy`).
        """
        try:
            return _groups[self.key]
        except KeyError:
            raise RuntimeError(
                "this DistributedOptimizer's process group was destroyed (distopt.shutdown() or close() ran); "
                "build a new wrapper after initializing the process group again"
            ) from None

    def destroy(self) -> None:
        """Destroy the group (local to this rank), if it may be destroyed before shutdown; idempotent."""
        if self.key in _keep_until_shutdown:
            return
        _destroy(self.key)


def _destroy(key: int) -> None:
    group = _groups.pop(key, None)
    _keep_until_shutdown.discard(key)
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def timeout_of(group: Optional[ProcessGroup]) -> Optional[timedelta]:
    """The collective timeout ``group`` was created with, or None if torch does not say."""
    try:
        group = group if group is not None else dist.distributed_c10d._get_default_group()
        for device in ("cpu", "cuda"):
            if torch.device(device) in group._device_types:
                return group._get_backend(torch.device(device)).options._timeout
    except Exception:  # private details of torch; without them the group gets torch's default
        pass
    return None


def create(parent: Optional[ProcessGroup], timeout: Optional[timedelta] = None) -> PrivateGroup:
    """Create a group with the same ranks as ``parent`` (None: the default group).

    Every rank of ``parent``, and only those, must call it, in the same order
    relative to their other group creations.

    Args:
        parent: the group whose ranks to take.
        timeout: the collective timeout; default: ``parent``'s (torch would give
            a new group its own default instead).
    """
    timeout = timeout if timeout is not None else timeout_of(parent)
    if parent is None:
        # Every rank takes part; the group gets a fresh numbered name, so destroying it later is safe.
        group = dist.new_group(ranks=None, timeout=timeout)
        local = False
    else:
        # Only the subgroup's ranks take part, so torch names the group by a hash of its ranks; a
        # destroyed group's name would be given again, with its stale addresses still in the store.
        # Such groups therefore stay until shutdown.
        group = build_by_members(dist.get_process_group_ranks(parent), dist.get_backend(parent), timeout)
        local = True
    key = next(_keys)
    _groups[key] = group
    if local:
        _keep_until_shutdown.add(key)
    return PrivateGroup(key)


def build_by_members(ranks: List[int], backend: Any, timeout: Optional[timedelta]) -> ProcessGroup:
    """A group of ``ranks`` (global ranks) built by its members alone: every member, and only those, calls
    it, in the same order relative to their other group creations.

    torch names such a group after its ranks and the number of groups this process holds. That number
    falls when a group is destroyed (a wrapper over the default group, closed), so the name of a group
    still alive can come round again, and torch refuses it ("The specified group name has already been
    created"), before any rank waits for another. Every member holds the same groups (each built them at
    the same point of the same script), so every member meets the same clash; each then builds a group of
    itself alone, which moves the count on alike everywhere, and tries again. Those are kept until
    :func:`destroy_all`.

    Raises:
        ValueError: the name still clashes after :data:`_MAX_FILLERS` tries.
    """
    for _ in range(_MAX_FILLERS):
        try:
            return dist.new_group(ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
        except ValueError as exc:
            if "already been created" not in str(exc):
                raise
            _fillers.append(dist.new_group(ranks=[dist.get_rank()], backend=backend, timeout=timeout,
                                           use_local_synchronization=True))
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=True)


def destroy_all() -> List["weakref.ReferenceType[ProcessGroup]"]:
    """Destroy every private group (before the default group is destroyed).

    Returns:
        Weak references to the destroyed groups, to check that nothing keeps one alive.
    """
    refs = [weakref.ref(group) for group in _groups.values()]
    for key in list(_groups):
        _destroy(key)
    if dist.is_initialized():
        for filler in _fillers:
            dist.destroy_process_group(filler)
    _fillers.clear()
    return refs
