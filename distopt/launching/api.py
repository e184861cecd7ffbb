"""The public entry points, :func:`launch` and its decorator form :func:`launcher`.

:func:`launch` runs a function in ``nprocs`` spawned worker processes, each with
an initialized ``torch.distributed`` process group, and returns their results in
rank order. If any worker raises, exits non-zero or is killed, the others are
terminated and :class:`~distopt.launching.WorkerFailedError` names the rank and
carries its traceback. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
in the environment) nothing is spawned: the process group is set up from
``env://`` and the function runs once, so one script works both ways.

This module checks the arguments, decides between spawning and running in place,
and starts the rendezvous store; the worker processes are :mod:`.worker`'s, and
the watch over them is :mod:`.supervisor`'s.
"""
from __future__ import annotations

import functools
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .lifecycle import as_timedelta, check_backend, default_backend, TimeoutLike, under_torchrun, init
from .supervisor import check_start_method, run_workers
from .worker import STORE_TIMEOUT, pickle_job

__all__ = ["DEFAULT_TIMEOUT", "launch", "launcher"]

#: Seconds :func:`launch` waits for its workers before killing them all.
DEFAULT_TIMEOUT: float = 1800.0


def _default_nprocs() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _check_int(value: Any, name: str, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}; {fix}")
    return value


def _resolve(master_addr: str, port: int, seconds: float) -> None:
    """Fail fast, naming the address, when ``master_addr`` does not resolve (DNS can take minutes)."""
    outcome: List[Any] = []

    def lookup() -> None:
        try:
            outcome.append(socket.getaddrinfo(master_addr, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"master_addr={master_addr!r} did not resolve within {seconds:g} s (launch's timeout); "
                           "pass node 0's IP address, or fix this machine's name resolution")
    if isinstance(outcome[0], OSError):
        raise ValueError(f"master_addr={master_addr!r} does not resolve ({outcome[0]}); pass node 0's IP address "
                         "or a host name this machine can resolve")


def _start_store(master_addr: str, master_port: int, seconds: float) -> Any:
    """The rendezvous store, on this machine, at ``master_addr:master_port``, within ``seconds``."""
    _resolve(master_addr, master_port, seconds)
    try:  # torch's server would wait the whole timeout for a client of its own to reach a foreign address
        family = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((master_addr, 0))
    except OSError as exc:
        raise ValueError(
            f"master_addr={master_addr!r} is not an address of this machine ({exc}), but node_rank=0 starts the "
            "rendezvous store there; run node 0 on the machine with that address, or pass one of this "
            "machine's addresses"
        ) from None
    try:
        return dist.TCPStore(master_addr, master_port, None, True, timedelta(seconds=seconds),
                             wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(
            f"could not start the rendezvous store on {master_addr}:{master_port}: {exc}; "
            "pass master_port=0 for a free port, or another port"
        ) from exc


def _run_in_place(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                  nprocs: Optional[int], backend: Optional[str], collective_timeout: TimeoutLike) -> List[Any]:
    """The torchrun path: this process is already one rank of the world."""
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    if nprocs is not None and local_world_size is not None and int(local_world_size) != nprocs:
        warnings.warn(
            f"launch(nprocs={nprocs}) runs under torchrun with LOCAL_WORLD_SIZE={local_world_size}: "
            "torchrun decides the number of processes (--nproc-per-node), so nprocs is ignored",
            stacklevel=3,
        )
    # The group outlives this call: torch restarts its group numbering when the
    # default group is destroyed, so a second init on torchrun's store would meet
    # the first group's stale rendezvous keys and hang.
    init(backend, timeout=collective_timeout)
    if isinstance(fn, _LaunchedFunction):
        fn = fn.__wrapped__
    return [fn(*args, **kwargs)]


def launch(
    fn: Callable[..., Any],
    nprocs: Optional[int] = None,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    backend: Optional[str] = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    timeout: Optional[float] = DEFAULT_TIMEOUT,
    collective_timeout: TimeoutLike = None,
    start_method: Optional[str] = None,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` worker processes with a process group.

    Workers are started with the ``spawn`` method (CUDA is never touched before
    a fork). Worker ``local`` on node ``node_rank`` gets global rank
    ``node_rank * nprocs + local``, the environment variables ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, its GPU as current device when the backend is NCCL, and an
    initialized default process group, destroyed when ``fn`` returns.

    If any worker raises, exits non-zero or is killed, the others get SIGTERM
    and, a few seconds later, SIGKILL; every process is reaped before
    :class:`WorkerFailedError` is raised. A worker that exits with code 0
    without returning (``sys.exit(0)``) gives ``None`` and a warning.

    When the process already runs under ``torchrun`` (``RANK``,
    ``WORLD_SIZE`` and ``MASTER_ADDR`` set) or already has a process group,
    nothing is spawned: :func:`init` sets up the group from ``env://`` (if
    there is none yet), ``fn`` runs once here, and the result is
    ``[fn(*args, **kwargs)]``. The group stays initialized afterwards, so
    later calls reuse it; :func:`shutdown` tears it down.

    Args:
        fn: the function to run; it must be picklable, i.e. defined at module level.
        nprocs: workers on this node. Default: the number of CUDA devices, or 2 without one.
        args: positional arguments for ``fn`` (picklable).
        kwargs: keyword arguments for ``fn`` (picklable).
        backend: process-group backend. Default: NCCL when each worker can have
            its own GPU, gloo otherwise.
        master_addr: address of node 0, where the rendezvous store runs.
        master_port: port of the rendezvous store; 0 picks a free one (single node only).
        nnodes: number of nodes, each running ``launch`` with the same arguments.
        node_rank: index of this node, ``0 <= node_rank < nnodes``.
        timeout: seconds for the whole launch, from starting the rendezvous store to
            the last worker's result, before every worker is killed; ``None`` waits forever.
        collective_timeout: the process group's collective timeout (torch's ``timeout=``),
            in seconds or as a ``timedelta``: a collective that waits longer fails
            (default: torch's, 30 minutes for gloo).
        start_method: how workers start: ``"forkserver"``, forked from a server that
            imported torch once (milliseconds a launch), or ``"spawn"``, a fresh
            interpreter each (a second or two to import torch, and no memory shared with
            the server, which a memory measurement may want) (default: ``"forkserver"``
            where the platform has it, else ``"spawn"``).

    Returns:
        The return values of this node's workers, in rank order.

    Raises:
        WorkerFailedError: a worker raised, exited non-zero or was killed.
        LaunchTimeoutError: the workers did not finish within ``timeout``.
        TypeError: ``fn`` or its arguments cannot be pickled, or an argument has the wrong type.
        ValueError: an argument is out of range (``nprocs < 1``, port 0 with ``nnodes > 1``, ...),
            or ``master_addr`` does not resolve or (on node 0) is not this machine's.
        TimeoutError: ``master_addr`` did not resolve within ``timeout``.
    """
    started = time.monotonic()
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    kwargs = {} if kwargs is None else kwargs
    check_start_method(start_method)
    collective_wait = as_timedelta(collective_timeout, "collective_timeout")
    if under_torchrun() or (dist.is_available() and dist.is_initialized()):
        return _run_in_place(fn, args, kwargs, nprocs, backend, collective_wait)

    nprocs = _default_nprocs() if nprocs is None else _check_int(nprocs, "nprocs", 1, "pass nprocs=2 or more")
    _check_int(nnodes, "nnodes", 1, "pass the number of machines")
    _check_int(node_rank, "node_rank", 0, "number the nodes 0..nnodes-1")
    if node_rank >= nnodes:
        raise ValueError(f"node_rank must be < nnodes={nnodes}, got {node_rank}; number the nodes 0..{nnodes - 1}")
    _check_int(master_port, "master_port", 0, "pass 0 for a free port")
    if master_port > 65535:
        raise ValueError(f"master_port must be <= 65535, got {master_port}")
    if nnodes > 1 and master_port == 0:
        raise ValueError(
            f"nnodes={nnodes} needs an explicit master_port that every node passes alike; "
            "port 0 (a free port) can only be picked on a single node"
        )
    wait = as_timedelta(timeout)
    if backend is None:
        backend = default_backend(nprocs)
    else:
        check_backend(backend, nprocs)
    job = pickle_job(fn, args, kwargs, unwrap=isinstance(fn, _LaunchedFunction))

    def left() -> float:  # of the whole launch's time, for the next stage
        limit = STORE_TIMEOUT.total_seconds() if wait is None else wait.total_seconds()
        return max(limit - (time.monotonic() - started), 0.001)

    store = None
    port = master_port
    if node_rank == 0:
        store = _start_store(master_addr, master_port, left())
        port = store.port
    else:
        _resolve(master_addr, master_port, left())
    try:
        return run_workers(
            job, nprocs, nnodes * nprocs, node_rank * nprocs, backend, master_addr, port,
            None if wait is None else left(), collective_wait, None if wait is None else wait.total_seconds(),
            start_method,
        )
    finally:
        del store


class _LaunchedFunction:
    """A function wrapped by :func:`launcher`; calling it launches the workers."""

    def __init__(self, fn: Callable[..., Any], options: Dict[str, Any]) -> None:
        functools.update_wrapper(self, fn)
        self._options = options

    def __call__(self, *args: Any, **kwargs: Any) -> List[Any]:
        return launch(self, args=args, kwargs=kwargs, **self._options)

    def __reduce__(self) -> str:
        # Pickled by name: the module attribute is this wrapper, not the bare function.
        return self.__qualname__


def launcher(
    fn: Optional[Callable[..., Any]] = None,
    /,
    nprocs: Optional[int] = None,
    *,
    backend: Optional[str] = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    timeout: Optional[float] = DEFAULT_TIMEOUT,
    collective_timeout: TimeoutLike = None,
    start_method: Optional[str] = None,
) -> Any:
    """Decorator form of :func:`launch`: calling the function runs it in every worker.

    Use it bare (``@launcher``) or with :func:`launch`'s options
    (``@launcher(nprocs=4)``). Calling the decorated function returns the list
    of the workers' results in rank order. The decorated function must be
    defined at module level, and a script must call it under
    ``if __name__ == "__main__":`` because the workers re-import the module.

    Args:
        fn: the function (given when used bare).
        nprocs: see :func:`launch`.
        backend: see :func:`launch`.
        master_addr: see :func:`launch`.
        master_port: see :func:`launch`.
        nnodes: see :func:`launch`.
        node_rank: see :func:`launch`.
        timeout: see :func:`launch`.
        collective_timeout: see :func:`launch`.
        start_method: see :func:`launch`.

    Returns:
        The wrapped function, or a decorator when ``fn`` is not given.
    """
    options = dict(nprocs=nprocs, backend=backend, master_addr=master_addr, master_port=master_port,
                   nnodes=nnodes, node_rank=node_rank, timeout=timeout, collective_timeout=collective_timeout,
                   start_method=start_method)
    if fn is None:
        return lambda inner: _LaunchedFunction(inner, options)
    if not callable(fn):
        raise TypeError(f"launcher decorates a function; got {fn!r}. Use @launcher or @launcher(nprocs=2)")
    return _LaunchedFunction(fn, options)
