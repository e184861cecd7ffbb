"""Start data-parallel workers that fail fast, or run unchanged under torchrun.

:func:`launch` runs a function in ``nprocs`` spawned worker processes, each with
an initialized ``torch.distributed`` process group, and returns their results in
rank order. If any worker raises, exits non-zero or is killed, the others are
terminated and :class:`WorkerFailedError` names the rank and carries its
traceback. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the
environment) nothing is spawned: the process group is set up from ``env://``
and the function runs once, so one script works both ways.

The only environment variables read or written are torchrun's ``env://``
contract: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import functools
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchError",
    "WorkerFailedError",
    "LaunchTimeoutError",
    "launch",
    "launcher",
    "init",
    "shutdown",
]

#: Seconds :func:`launch` waits for its workers before killing them all.
DEFAULT_TIMEOUT: float = 1800.0

# Seconds a worker gets between SIGTERM and SIGKILL.
_TERMINATE_GRACE = 3.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long a worker waits to reach the parent's rendezvous store.
_STORE_TIMEOUT = timedelta(seconds=300)

_Timeout = Union[float, int, timedelta, None]


# ---------------------------------------------------------------------------
# errors


class LaunchError(RuntimeError):
    """Base class of the errors :func:`launch` raises when its workers do not all succeed."""


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker failed.

    Attributes:
        rank: global rank of the worker.
        local_rank: index of the worker on this node.
        exitcode: the process exit code; negative for a signal, ``None`` if it
            was still running when the failure was reported.
        traceback: the worker's formatted Python traceback, or ``None`` when it
            died without raising (``os._exit``, a signal, a crash).
        when: ``time.time()`` at which the failure happened or was noticed.
        started: whether the worker got as far as distopt's entry point (past
            importing the main module and the spawn start-up).
    """

    rank: int
    local_rank: int
    exitcode: Optional[int]
    traceback: Optional[str]
    when: float
    started: bool = True

    @property
    def signal_name(self) -> Optional[str]:
        """Name of the signal that killed the worker (``"SIGKILL"``), or ``None``."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        """One line: what happened to this worker."""
        if self.signal_name is not None:
            how = f"was killed by {self.signal_name}"
        elif self.traceback is not None:
            last = self.traceback.strip().splitlines()[-1] if self.traceback.strip() else "an exception"
            how = f"raised {last}"
            if self.exitcode is not None:
                how += f" (exit code {self.exitcode})"
        elif self.exitcode is not None:
            how = f"exited with code {self.exitcode}"
        else:
            how = "failed"
        return f"worker rank {self.rank} (local rank {self.local_rank}) {how}"


class WorkerFailedError(LaunchError):
    """A worker raised, exited non-zero or was killed; all other workers were terminated.

    Attributes:
        rank: global rank of the worker that failed first.
        exitcode: its exit code (negative: killed by signal ``-exitcode``).
        signal_name: the signal's name (``"SIGKILL"``) when it was killed, else ``None``.
        traceback: the worker's Python traceback, or ``None`` when it died without raising.
        failures: every failure noticed, the first one first.
    """

    def __init__(self, failures: Sequence[WorkerFailure]) -> None:
        first = failures[0]
        self.failures: List[WorkerFailure] = list(failures)
        self.rank: int = first.rank
        self.exitcode: Optional[int] = first.exitcode
        self.signal_name: Optional[str] = first.signal_name
        self.traceback: Optional[str] = first.traceback
        lines = [first.describe() + "; the other workers were terminated."]
        if first.traceback:
            lines += [f"Traceback of rank {first.rank}:", first.traceback.rstrip()]
        elif not first.started:
            lines.append(
                "It died while starting, before fn ran; its output above says why. A script that calls "
                "launch must do so under `if __name__ == \"__main__\":`, since workers re-import it."
            )
        else:
            lines.append("It left no Python traceback (os._exit, a signal or a crash); check its output above.")
        for other in failures[1:]:
            lines.append(f"Also: {other.describe()}.")
        super().__init__("\n".join(lines))


class LaunchTimeoutError(LaunchError):
    """The workers did not all finish within ``timeout``; all of them were killed.

    Attributes:
        timeout: the limit in seconds.
        running: global ranks still running when the limit was reached.
    """

    def __init__(self, timeout: float, running: Sequence[int], finished: Sequence[int]) -> None:
        self.timeout = timeout
        self.running = list(running)
        super().__init__(
            f"launch timed out after {timeout:g} s: ranks {self.running} were still running "
            f"(ranks {list(finished)} had finished) and all were killed. Pass a larger timeout= "
            "if the work needs longer, or look for a hang such as a collective that not every rank calls."
        )


# ---------------------------------------------------------------------------
# process-group set-up


def _under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def _as_timedelta(timeout: _Timeout, name: str = "timeout") -> Optional[timedelta]:
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


def _uses_cuda(backend: str) -> bool:
    return "nccl" in backend.lower()


def _default_backend(local_world_size: int) -> str:
    """NCCL for CUDA tensors when every local rank can have a GPU of its own (gloo still
    serves CPU tensors, e.g. metrics), gloo alone otherwise."""
    if dist.is_nccl_available() and torch.cuda.is_available() and local_world_size <= torch.cuda.device_count():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _check_backend(backend: str, local_world_size: int) -> None:
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a string such as 'gloo' or 'nccl', got {backend!r}")
    if _uses_cuda(backend):
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError(f"backend={backend!r} needs CUDA and NCCL, which this machine lacks; use backend='gloo'")
        if local_world_size > torch.cuda.device_count():
            raise ValueError(
                f"backend={backend!r} gives each local rank its own GPU, but {local_world_size} local ranks "
                f"were asked for and only {torch.cuda.device_count()} GPUs are visible; lower nprocs "
                "or use backend='gloo'"
            )


def init(backend: Optional[str] = None, timeout: _Timeout = None) -> None:
    """Initialize the default process group from ``env://``; a no-op if one exists.

    This is what a script started by ``torchrun`` calls. It reads ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` if set) and, with a CUDA backend, makes GPU
    ``LOCAL_RANK`` the current device.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or any backend string torch accepts.
            Default: NCCL when each local rank can have its own GPU, else gloo.
        timeout: collective timeout in seconds or as a ``timedelta``;
            default: torch's default for the backend.

    Raises:
        RuntimeError: if the ``env://`` variables are missing.
        ValueError: if ``backend`` needs GPUs this machine lacks, or ``timeout`` is not positive.
    """
    wait = _as_timedelta(timeout)
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
        backend = _default_backend(max(local_world_size, local_rank + 1))
    else:
        _check_backend(backend, local_rank + 1)
    if _uses_cuda(backend):
        torch.cuda.set_device(local_rank)
    _init_process_group(backend=backend, init_method="env://", timeout=wait)
    atexit.register(shutdown)


def _init_process_group(**kwargs: Any) -> None:
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
    """Destroy the default process group; a no-op without one.

    Warns if the group outlives this call (something still references it), since
    its threads would then run into interpreter exit, where they can abort the process.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    if group() is not None:
        gc.collect()  # a reference cycle (e.g. a DDP module that holds the group) is not a leak
    if group() is not None:
        warnings.warn(
            "distopt.shutdown() destroyed the default process group, but something still references it, so its "
            f"communication threads stay alive and can abort the process at exit. {_who_holds(group())}",
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


# ---------------------------------------------------------------------------
# the worker side


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """Make the kernel kill this worker if the launching process dies, so none is orphaned."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # 1 == PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(spec: _WorkerSpec, job: bytes, conn: Connection) -> None:
    """Entry point of a spawned worker: set up the group, run the job, report back."""
    _die_with_parent(spec.parent_pid)
    conn.send(("started",))
    if hasattr(os, "setpgrp"):
        # Its own process group lets the parent stop the worker together with
        # anything it started (data-loader workers, ...).
        os.setpgrp()
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.local_rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )
    try:
        fn, args, kwargs = pickle.loads(job)
        if isinstance(fn, _LaunchedFunction):
            fn = fn.__wrapped__
        if _uses_cuda(spec.backend):
            torch.cuda.set_device(spec.local_rank)
        # Like torchrun, share the cores between the local workers: N workers each running as
        # many intra-op threads as there are cores oversubscribe the CPU and slow every op.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // spec.local_world_size))
        # The parent owns the rendezvous store, so port 0 never races for a port.
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, _STORE_TIMEOUT)
        _init_process_group(backend=spec.backend, store=store, rank=spec.rank, world_size=spec.world_size)
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        else:
            conn.send(("ok", result))
        del fn, args, kwargs  # so that nothing of the job keeps the group alive past shutdown()
        shutdown()
    except BaseException as exc:
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        _report_and_exit(conn, traceback.format_exc(), code)
    conn.close()


def _report_and_exit(conn: Connection, formatted: str, code: int) -> None:
    try:
        conn.send(("error", time.time(), formatted))
        conn.close()
    except BaseException:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a peer may be stuck in a collective with us.
    os._exit(code)


# ---------------------------------------------------------------------------
# the parent side


def _default_nprocs() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _check_int(value: Any, name: str, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}; {fix}")
    return value


def _pickle_job(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise TypeError(
            f"launch could not pickle fn={getattr(fn, '__qualname__', fn)!r} with its args/kwargs for the "
            "spawned workers: define fn at module level (not a lambda or a nested function) and pass "
            f"picklable arguments. Pickle said: {exc}"
        ) from exc


def _run_in_place(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                  nprocs: Optional[int], backend: Optional[str]) -> List[Any]:
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
    init(backend)
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
        timeout: seconds to wait for all workers before killing them, or ``None`` to wait forever.

    Returns:
        The return values of this node's workers, in rank order.

    Raises:
        WorkerFailedError: a worker raised, exited non-zero or was killed.
        LaunchTimeoutError: the workers did not finish within ``timeout``.
        TypeError: ``fn`` or its arguments cannot be pickled, or an argument has the wrong type.
        ValueError: an argument is out of range (``nprocs < 1``, port 0 with ``nnodes > 1``, ...).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    kwargs = {} if kwargs is None else kwargs
    if _under_torchrun() or (dist.is_available() and dist.is_initialized()):
        return _run_in_place(fn, args, kwargs, nprocs, backend)

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
    wait = _as_timedelta(timeout)
    if backend is None:
        backend = _default_backend(nprocs)
    else:
        _check_backend(backend, nprocs)
    job = _pickle_job(fn, args, kwargs)

    store = None
    port = master_port
    if node_rank == 0:
        try:
            store = dist.TCPStore(master_addr, master_port, None, True, _STORE_TIMEOUT, wait_for_workers=False)
        except Exception as exc:
            raise RuntimeError(
                f"could not start the rendezvous store on {master_addr}:{master_port}: {exc}; "
                "pass master_port=0 for a free port, or another port"
            ) from exc
        port = store.port
    try:
        return _run_workers(
            job, nprocs, nnodes * nprocs, node_rank * nprocs, backend, master_addr, port,
            None if wait is None else wait.total_seconds(),
        )
    finally:
        del store


def _run_workers(job: bytes, nprocs: int, world_size: int, first_rank: int, backend: str,
                 master_addr: str, master_port: int, timeout: Optional[float]) -> List[Any]:
    ctx = mp.get_context("spawn")
    procs: List[BaseProcess] = []
    readers: List[Connection] = []
    try:
        for local in range(nprocs):
            spec = _WorkerSpec(first_rank + local, local, world_size, nprocs, master_addr, master_port,
                               backend, os.getpid())
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, args=(spec, job, writer), name=f"distopt-rank{spec.rank}")
            readers.append(reader)
            procs.append(proc)
            try:
                proc.start()
            finally:
                # Our copy of the write end must go, or a dead worker's pipe never reports EOF.
                writer.close()
        return _Supervisor(procs, readers, first_rank).wait(timeout)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()


class _Supervisor:
    """Collects results while watching every worker; stops at the first failure."""

    def __init__(self, procs: List[BaseProcess], readers: List[Connection], first_rank: int) -> None:
        self.procs = procs
        self.readers = readers
        self.first_rank = first_rank
        self.results: List[Any] = [None] * len(procs)
        self.returned = [False] * len(procs)
        self.started = [False] * len(procs)
        self.errors: Dict[int, Tuple[float, str]] = {}
        self.open_readers = {reader: i for i, reader in enumerate(readers)}
        self.live = {proc.sentinel: i for i, proc in enumerate(procs)}

    def wait(self, timeout: Optional[float]) -> List[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        failures: List[WorkerFailure] = []
        while self.live and not failures:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                running = sorted(self.first_rank + i for i in self.live.values())
                finished = sorted(set(range(self.first_rank, self.first_rank + len(self.procs))) - set(running))
                raise LaunchTimeoutError(timeout or 0.0, running, finished)
            # A worker that dies without a word died at some point during this wait;
            # dating it to the wait's start ranks it before the errors its death causes in peers.
            since = time.time()
            # Reading pipes as results arrive keeps a large result from blocking its worker's exit.
            for ready in connection.wait(list(self.open_readers) + list(self.live), remaining):
                if ready in self.open_readers:
                    self._receive(self.open_readers[ready])
                else:
                    failures += self._exited(self.live.pop(ready), since)
            failures += [self._failure(i, None, since) for i in self.errors if i in self.live.values()]
        if failures:
            raise WorkerFailedError(self._settle(failures))
        silent = [self.first_rank + i for i, done in enumerate(self.returned) if not done]
        if silent:
            warnings.warn(
                f"worker ranks {silent} exited with code 0 but did not return a value "
                "(sys.exit(0) or os._exit(0) in fn); their results are None",
                stacklevel=4,
            )
        return self.results

    def _receive(self, i: int) -> None:
        reader = self.readers[i]
        try:
            message = reader.recv()
        except EOFError:
            del self.open_readers[reader]
            return
        except Exception as exc:  # the result could not be unpickled here
            self.errors.setdefault(i, (time.time(), f"the result of rank {self.first_rank + i} could not be "
                                                  f"unpickled by the launching process: {exc!r}\n"))
            return
        if message[0] == "started":
            self.started[i] = True
        elif message[0] == "ok":
            self.results[i] = message[1]
            self.returned[i] = True
        else:
            self.errors.setdefault(i, (message[1], message[2]))

    def _exited(self, i: int, since: float) -> List[WorkerFailure]:
        proc = self.procs[i]
        proc.join()
        reader = self.readers[i]
        # A dead worker's messages are all in the pipe now; poll() first in case
        # something it forked still holds the write end open.
        while reader in self.open_readers and reader.poll(0):
            self._receive(i)
        if proc.exitcode == 0 and i not in self.errors:
            return []
        return [self._failure(i, proc.exitcode, since)]

    def _failure(self, i: int, exitcode: Optional[int], since: float) -> WorkerFailure:
        when, formatted = self.errors.get(i, (since, None))
        return WorkerFailure(self.first_rank + i, i, exitcode, formatted, when, self.started[i])

    def _settle(self, failures: List[WorkerFailure]) -> List[WorkerFailure]:
        """Let workers that reported an error exit by themselves, so their real exit codes are reported."""
        settled = []
        for failure in failures:
            proc = self.procs[failure.local_rank]
            if failure.exitcode is None:
                proc.join(_TERMINATE_GRACE)
                failure = replace(failure, exitcode=proc.exitcode)
            settled.append(failure)
        unique = {f.rank: f for f in sorted(settled, key=lambda f: f.when, reverse=True)}
        return sorted(unique.values(), key=lambda f: f.when)


def _signal_worker(proc: BaseProcess, sig: int) -> None:
    pid = proc.pid
    if pid is None or proc.exitcode is not None:
        return
    try:
        if hasattr(os, "killpg") and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: Sequence[BaseProcess]) -> None:
    """SIGTERM every live worker, SIGKILL what is left after a grace period, and reap all."""
    started = [proc for proc in procs if proc.pid is not None]
    alive = [proc for proc in started if proc.is_alive()]
    for proc in alive:
        _signal_worker(proc, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            _signal_worker(proc, signal.SIGKILL)
    for proc in started:
        proc.join()


# ---------------------------------------------------------------------------
# decorator form


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

    Returns:
        The wrapped function, or a decorator when ``fn`` is not given.
    """
    options = dict(nprocs=nprocs, backend=backend, master_addr=master_addr, master_port=master_port,
                   nnodes=nnodes, node_rank=node_rank, timeout=timeout)
    if fn is None:
        return lambda inner: _LaunchedFunction(inner, options)
    if not callable(fn):
        raise TypeError(f"launcher decorates a function; got {fn!r}. Use @launcher or @launcher(nprocs=2)")
    return _LaunchedFunction(fn, options)
