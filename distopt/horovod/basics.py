"""The job: :func:`init` and :func:`shutdown`, ranks and sizes, and what this build supports.

The state :func:`init` sets up (which ranks share a machine, whether it created
the process group) lives here, in one module-level session.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import collectives
from ..transport import private_groups
from ..launching.process_group import under_torchrun as _under_torchrun
from ..launching.process_group import init as _init_process_group
from ..launching.process_group import shutdown as _destroy_process_group

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "ccl_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "cuda_built",
    "rocm_built",
]


# ====================================================================== life cycle


@dataclass
class _Session:
    initialized: bool = False
    owns_group: bool = False  # init() created the process group, so shutdown() destroys it
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    lane: Optional[private_groups.PrivateGroup] = None  # the ranks' group for tensor collectives


_session = _Session()

_NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Join the job: set up the process group from ``torchrun``'s environment.

    Under ``torchrun`` this initializes the default process group (see
    :func:`distopt.launching.init`: NCCL when every local rank has a GPU, else
    gloo). If a process group already exists (e.g. inside :func:`distopt.launch`)
    it is used as is. Started as a plain ``python script.py``, the script runs as
    a job of one process, as it would with Horovod. Every rank must call it: the
    ranks exchange host names to learn :func:`local_size` and :func:`cross_size`.
    Calling it again before :func:`shutdown` does nothing.

    Args:
        comm: an MPI communicator in Horovod; must be None.
        process_sets: process sets (or lists of ranks) to add right away, as
            :func:`~distopt.horovod.add_process_set` would (default: None).

    Raises:
        NotImplementedError: if ``comm`` is given.
    """
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) takes an MPI communicator, and distopt.horovod runs on torch.distributed "
            "without MPI; call hvd.init() and start the script with torchrun --nproc-per-node N"
        )
    if _session.initialized:
        return
    if not collectives.is_distributed() and _under_torchrun():
        _init_process_group()
        _session.owns_group = True
    _learn_topology()
    if collectives.is_distributed():
        # Tensor collectives run on a background thread; on a group of their own, they never pair
        # with what the calling thread runs meanwhile (barriers, object collectives, the user's own).
        _session.lane = private_groups.create(None)
    _session.initialized = True
    if process_sets is not None:
        from .process_sets import add_process_set  # it needs the session this function sets up

        for process_set in process_sets:
            add_process_set(process_set)


def _learn_topology() -> None:
    """Which ranks share this machine: one gather of every rank's host name at init."""
    me = collectives.get_rank()
    hosts = collectives.all_gather_object(socket.gethostname())
    machines = list(dict.fromkeys(hosts))  # in order of their first rank
    _session.local_rank = collectives.get_local_rank()
    _session.local_size = hosts.count(hosts[me])
    _session.cross_rank = machines.index(hosts[me])
    _session.cross_size = len(machines)


def shutdown() -> None:
    """Leave the job; destroys the process group if :func:`init` created it. Idempotent."""
    from . import background
    from .process_sets import _forget_all

    background.stop()
    _forget_all()
    if _session.lane is not None:
        _session.lane.destroy()
        _session.lane = None
    if _session.owns_group:
        _destroy_process_group()
    _session.initialized = False
    _session.owns_group = False


def is_initialized() -> bool:
    """Whether :func:`init` was called (and :func:`shutdown` was not since)."""
    return _session.initialized


def _require_init() -> None:
    if not _session.initialized:
        raise ValueError(_NOT_INITIALIZED)


# ====================================================================== ranks and sizes


def size() -> int:
    """Number of processes in the job.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return collectives.get_world_size()


def rank() -> int:
    """Rank of this process, ``0 .. size() - 1``.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return collectives.get_rank()


def local_size() -> int:
    """Number of processes on this machine (``torchrun --nproc-per-node``).

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.local_size


def local_rank() -> int:
    """Rank of this process on this machine, e.g. to pick its GPU.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.local_rank


def cross_size() -> int:
    """Number of machines in the job.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.cross_size


def cross_rank() -> int:
    """Index of this machine, machines numbered in the order of their lowest rank.

    Raises:
        ValueError: if :func:`init` was not called.
    """
    _require_init()
    return _session.cross_rank


# ====================================================================== what this build supports


def mpi_built() -> bool:
    """False: distopt runs on torch.distributed, without MPI."""
    return False


def mpi_enabled() -> bool:
    """False: distopt runs on torch.distributed, without MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI; torch.distributed collectives may be called from any thread."""
    return False


def ccl_built() -> bool:
    """False: distopt has no oneCCL backend (torch.distributed's gloo and NCCL)."""
    return False


def ddl_built() -> bool:
    """False: distopt has no IBM DDL backend."""
    return False


def gloo_built() -> bool:
    """Whether this torch build has the gloo backend."""
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Whether the job's process group uses gloo (for at least CPU tensors)."""
    return collectives.is_distributed() and "gloo" in str(dist.get_backend())


def nccl_built() -> int:
    """NCCL's version code if this torch build has the NCCL backend (truthy, comparable as Horovod's:
    ``major * 10000 + minor * 100 + patch`` from NCCL 2.9, ``* 1000`` before), else 0."""
    if not (dist.is_available() and dist.is_nccl_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except Exception:  # built with NCCL, but its library cannot be asked: still built
        return 1
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def cuda_built() -> bool:
    """Whether this torch build supports CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether this torch build is for ROCm."""
    return torch.version.hip is not None


# ====================================================================== the group and ranks collectives use


def _world() -> Optional[dist.ProcessGroup]:
    """The process group collectives run on, or None for a job of one process without a group."""
    _require_init()
    return dist.group.WORLD if collectives.is_distributed() else None


def _lane() -> Optional[dist.ProcessGroup]:
    """The group tensor collectives of the whole job run on, or None for a job of one process."""
    _require_init()
    return _session.lane.group if _session.lane is not None and collectives.is_distributed() else None


def _check_root(root_rank: Any) -> int:
    world = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ValueError(f"root_rank must be a rank of the job (0..{world - 1}), got {root_rank!r}")
    return root_rank
