"""The job: :func:`init` and :func:`shutdown`, and what this build supports.

The state :func:`init` sets up (which ranks share a machine, whether it created
the process group), and the ranks and sizes read from it, live in :mod:`.session`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import collectives
from . import background
from .process_sets import add_process_set, forget_all
from .session import close_session, is_initialized, open_session

__all__ = [
    "init",
    "shutdown",
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


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Join the job: set up the process group from ``torchrun``'s environment.

    Under ``torchrun`` this initializes the default process group (see
    :func:`distopt.launching.init`: NCCL when every local rank has a GPU, else
    gloo). If a process group already exists (e.g. inside :func:`distopt.launch`)
    it is used as is. Started as a plain ``python script.py``, the script runs as
    a job of one process, as it would with Horovod. Every rank must call it: the
    ranks exchange host names to learn :func:`~.session.local_size` and
    :func:`~.session.cross_size`. Calling it again before :func:`shutdown` does
    nothing.

    As horovodrun does for its workers, it sets ``HOROVOD_RANK``, ``HOROVOD_SIZE``,
    ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK`` and
    ``HOROVOD_CROSS_SIZE`` in this process's environment, for scripts that read them;
    :func:`shutdown` removes them. They are written, never read.

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
    if is_initialized():
        return
    open_session()
    if process_sets is not None:
        for process_set in process_sets:
            add_process_set(process_set)


def shutdown() -> None:
    """Leave the job; destroys the process group if :func:`init` created it, and removes the
    ``HOROVOD_*`` variables :func:`init` set. Idempotent."""
    background.stop()
    forget_all()
    close_session()


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
