"""The job's session: the state :func:`~.basics.init` sets up, and what reads it.

Whether the job is initialized, its ranks and sizes (which ranks share a
machine), and the groups its collectives run on live here, in one module-level
session; :func:`~.basics.init` and :func:`~.basics.shutdown` open and close it
with :func:`open_session` and :func:`close_session`.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .. import collectives
from ..transport import private_groups
from ..launching.lifecycle import under_torchrun
from ..launching.lifecycle import init as _init_process_group
from ..launching.lifecycle import shutdown as _destroy_process_group

# Horovod's names only; open_session, close_session, require_init, generation, world_group, world_lane
# and check_root serve the other modules here and are nothing for Horovod users.
__all__ = [
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
]


@dataclass
class _Session:
    initialized: bool = False
    owns_group: bool = False  # open_session() created the process group, so close_session() destroys it
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    lane: Optional[private_groups.PrivateGroup] = None  # the ranks' group for tensor collectives


_session = _Session()
# How many sessions open_session() has opened: what was built in an earlier one belongs to a job left.
_opened = 0

_NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


# ====================================================================== opening and closing


def open_session() -> None:
    """Set up the process group (under ``torchrun``, if none exists), the topology and the lane.

    Collective: every rank exchanges its host name. Does nothing if the session is open.
    Sets horovodrun's variables (``HOROVOD_RANK``, ...) in this process; :func:`close_session`
    removes them.
    """
    global _opened
    if _session.initialized:
        return
    if not collectives.is_distributed() and under_torchrun():
        _init_process_group()
        _session.owns_group = True
    _learn_topology()
    if collectives.is_distributed():
        # Tensor collectives run on a background thread; on a group of their own, they never pair
        # with what the calling thread runs meanwhile (barriers, object collectives, the user's own).
        _session.lane = private_groups.create(None)
    _session.initialized = True
    _opened += 1
    _export()


#: The variables horovodrun sets in each worker, which Horovod users' scripts read.
_HOROVOD_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                      "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def _export() -> None:
    """Set horovodrun's variables in this process, from the session: torchrun does not set them.

    Written, never read: the session's values come from the process group alone.
    """
    values = (collectives.get_rank(), collectives.get_world_size(), _session.local_rank, _session.local_size,
              _session.cross_rank, _session.cross_size)
    os.environ.update({name: str(value) for name, value in zip(_HOROVOD_VARIABLES, values)})


def _learn_topology() -> None:
    """Which ranks share this machine: one gather of every rank's host name at init."""
    me = collectives.get_rank()
    hosts = collectives.all_gather_object(socket.gethostname())
    machines = list(dict.fromkeys(hosts))  # in order of their first rank
    _session.local_rank = collectives.get_local_rank()
    _session.local_size = hosts.count(hosts[me])
    _session.cross_rank = machines.index(hosts[me])
    _session.cross_size = len(machines)


def close_session() -> None:
    """Destroy the lane, and the process group if :func:`open_session` created it. Idempotent."""
    if _session.lane is not None:
        _session.lane.destroy()
        _session.lane = None
    if _session.owns_group:
        _destroy_process_group()
    if _session.initialized:  # the values describe a job this process has left
        for name in _HOROVOD_VARIABLES:
            os.environ.pop(name, None)
    _session.initialized = False
    _session.owns_group = False


def is_initialized() -> bool:
    """Whether :func:`~distopt.horovod.init` was called (and :func:`~distopt.horovod.shutdown` was not since)."""
    return _session.initialized


def generation() -> int:
    """Which session is open: it counts the calls of :func:`~distopt.horovod.init` that opened one.

    The same on every rank, since every rank calls ``init()`` and ``shutdown()``.
    """
    return _opened


def require_init() -> None:
    """Raise unless the session is open.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    if not _session.initialized:
        raise ValueError(_NOT_INITIALIZED)


# ====================================================================== ranks and sizes


def size() -> int:
    """Number of processes in the job.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return collectives.get_world_size()


def rank() -> int:
    """Rank of this process, ``0 .. size() - 1``.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return collectives.get_rank()


def local_size() -> int:
    """Number of processes on this machine (``torchrun --nproc-per-node``).

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return _session.local_size


def local_rank() -> int:
    """Rank of this process on this machine, e.g. to pick its GPU.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return _session.local_rank


def cross_size() -> int:
    """Number of machines in the job.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return _session.cross_size


def cross_rank() -> int:
    """Index of this machine, machines numbered in the order of their lowest rank.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return _session.cross_rank


def check_root(root_rank: Any) -> int:
    """``root_rank`` if it is a rank of the job.

    Raises:
        ValueError: it is not an int in ``0 .. size() - 1``.
    """
    world = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ValueError(f"root_rank must be a rank of the job (0..{world - 1}), got {root_rank!r}")
    return root_rank


# ====================================================================== the groups collectives use


def world_group() -> Optional[dist.ProcessGroup]:
    """The process group collectives run on, or None for a job of one process without a group.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return dist.group.WORLD if collectives.is_distributed() else None


def world_lane() -> Optional[dist.ProcessGroup]:
    """The group tensor collectives of the whole job run on, or None for a job of one process.

    Raises:
        ValueError: if :func:`~distopt.horovod.init` was not called.
    """
    require_init()
    return _session.lane.group if _session.lane is not None and collectives.is_distributed() else None
