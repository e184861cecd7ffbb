"""The process group itself: :func:`init` and :func:`shutdown`, and the backend a job gets.

:func:`init` is what a script started by ``torchrun`` calls; the spawned workers
of :func:`~distopt.launching.launch` set up their group through the same
:func:`init_default_group`, and tear it down with the same :func:`shutdown`.
The only environment variables read here are torchrun's ``env://`` contract.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import warnings
import weakref
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ..transport import private_groups, stalls
from .interface import pick_interface

__all__ = [
    "init",
    "shutdown",
    "TimeoutLike",
    "under_torchrun",
    "as_timedelta",
    "uses_cuda",
    "default_backend",
    "check_backend",
    "init_default_group",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

TimeoutLike = Union[float, int, timedelta, None]


def under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def as_timedelta(timeout: TimeoutLike, name: str = "timeout") -> Optional[timedelta]:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{name} must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{name} must be positive, got {timeout!r}; pass e.g. {name}=600")
    return timedelta(seconds=seconds)


def uses_cuda(backend: str) -> bool:
    return "nccl" in backend.lower()


def default_backend(local_world_size: int) -> str:
    """NCCL for CUDA tensors when every local rank can have a GPU of its own (gloo still
    serves CPU tensors, e.g. metrics), gloo alone otherwise."""
    if dist.is_nccl_available() and torch.cuda.is_available() and local_world_size <= torch.cuda.device_count():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def check_backend(backend: str, local_world_size: int) -> None:
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a string such as 'gloo' or 'nccl', got {backend!r}")
    if uses_cuda(backend):
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError(f"backend={backend!r} needs CUDA and NCCL, which this machine lacks; use backend='gloo'")
        if local_world_size > torch.cuda.device_count():
            raise ValueError(
                f"backend={backend!r} gives each local rank its own GPU, but {local_world_size} local ranks "
                f"were asked for and only {torch.cuda.device_count()} GPUs are visible; lower nprocs "
                "or use backend='gloo'"
            )


def init(backend: Optional[str] = None, timeout: TimeoutLike = None) -> None:
    """Initialize the default process group from ``env://``; a no-op if one exists.

    This is what a script started by ``torchrun`` calls. It reads ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` if set) and, with a CUDA backend, makes GPU
    ``LOCAL_RANK`` the current device. When ``MASTER_ADDR`` is not a loopback
    address and neither ``GLOO_SOCKET_IFNAME`` nor ``NCCL_SOCKET_IFNAME`` is set,
    it points both at the interface that routes to ``MASTER_ADDR`` and says so.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or any backend string torch accepts.
            Default: NCCL when each local rank can have its own GPU, else gloo.
        timeout: collective timeout in seconds or as a ``timedelta``;
            default: torch's default for the backend.

    Raises:
        RuntimeError: if the ``env://`` variables are missing.
        ValueError: if ``backend`` needs GPUs this machine lacks, or ``timeout`` is not positive.
    """
    wait = as_timedelta(timeout)
    if dist.is_initialized():
        if backend is not None and backend != dist.get_backend():
            warnings.warn(
                f"init(backend={backend!r}) ignored: the process group is already initialized with "
                f"backend {dist.get_backend()!r}; call shutdown() first to change it",
                stacklevel=2,
            )
        return
    missing = [name for name in _ENV_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init() sets up the process group from env://, but {', '.join(missing)} "
            "is not set in the environment; start the script with torchrun "
            "(python -m torch.distributed.run --nproc-per-node N script.py) or use distopt.launch(fn)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend is None:
        backend = default_backend(max(local_world_size, local_rank + 1))
    else:
        check_backend(backend, local_rank + 1)
    if uses_cuda(backend):
        torch.cuda.set_device(local_rank)
    pick_interface(os.environ["MASTER_ADDR"], announce=local_rank == 0)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    global _generation
    if restart is None and _generation == 0:
        init_default_group(backend=backend, init_method="env://", timeout=wait)
    else:
        init_default_group(backend=backend, store=_attempt_store(restart or "0", _generation, wait),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=wait)
    _generation += 1
    atexit.register(shutdown)


#: How many times this process set up the group with :func:`init` (again after ``shutdown()``).
_generation = 0


def _attempt_store(restart: str, generation: int, wait: Optional[timedelta]) -> Any:
    """torchrun's store, under a prefix of this attempt's and this set-up's own.

    After ``--max-restarts`` restarts the group, the store still holds the first attempt's
    rendezvous keys (its ranks' addresses); a new attempt that reads one connects to a
    process that is gone ("Connection refused"). torchrun numbers its attempts in
    ``TORCHELASTIC_RESTART_COUNT``, so each attempt gets a prefix of its own; so does each
    set-up after a ``shutdown()`` in the same process (the old addresses are gone too).
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=wait or timedelta(minutes=30))
    return dist.PrefixStore(f"distopt/attempt{restart}/setup{generation}/", store)


def init_default_group(**kwargs: Any) -> None:
    """``dist.init_process_group``, after the one import that would otherwise keep the group alive.

    ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as a default
    argument when it is first imported, and ``torch.optim`` imports it (through
    ``torch._dynamo``) the first time an optimizer is built. Imported after the
    group exists, it captures the group for good: ``destroy_process_group()``
    then cannot free it, gloo's worker threads run on into interpreter exit, and
    one that drops the last reference to a finished collective there needs the
    GIL, cannot get it and aborts the process ("terminate called without an
    active exception"). Imported first, it binds ``None``.
    """
    import torch.distributed.nn.functional  # noqa: F401  (see above)

    dist.init_process_group(**kwargs)


def shutdown() -> None:
    """Destroy the default process group and the private groups of distopt's wrappers; a no-op without one.

    Warns if the default group outlives this call (something still references it),
    since its threads would then run into interpreter exit, where they can abort the process.
    Called while an exception is being handled or is on its way out (in an ``except`` block
    before ``sys.exit(1)``, in a ``finally``), this rank did not finish: the peers are told
    that it crashed, with that exception (``SystemExit`` with code 0 or None counts as finishing).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    # Before the groups go: a peer whose collective fails when ours close reads why we left (called in a
    # ``finally`` block an exception passes through, it is that exception).
    stalls.mark_exit(stalls.ending())
    stalls.stop()
    groups = private_groups.destroy_all()
    groups.append(weakref.ref(dist.distributed_c10d._get_default_group()))
    dist.destroy_process_group()
    if any(ref() is not None for ref in groups):
        gc.collect()  # a reference cycle (e.g. a DDP module that holds the group) is not a leak
    alive = [ref() for ref in groups if ref() is not None]
    if alive:
        warnings.warn(
            "distopt.shutdown() destroyed the process groups, but something still references one, so its "
            f"communication threads stay alive and can abort the process at exit. {_who_holds(alive[-1])}",
            RuntimeWarning,
            stacklevel=2,
        )


def _who_holds(group: Any) -> str:
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None and any(
        group in (getattr(fn, "__defaults__", None) or ()) for fn in vars(functional).values()
    ):
        return (
            "torch.distributed.nn.functional was imported after the group was created and holds it as a default "
            "argument (building the first torch.optim optimizer imports it): create the group with distopt.init() "
            "or distopt.launch(), or import torch.distributed.nn.functional before init_process_group()."
        )
    return "Drop your own references to it (e.g. a saved dist.group.WORLD or a process_group= attribute) first."
