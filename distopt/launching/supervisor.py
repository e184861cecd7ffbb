"""The launching process's side of :func:`~distopt.launching.launch`: start the workers and watch them.

:func:`run_workers` starts one process per local rank and hands them to a
:class:`_Supervisor`, which collects their results as they arrive and stops at
the first failure or at the timeout. Whatever happens, :func:`_stop` then
terminates every worker still alive, and what any worker that did not finish
cleanly started (SIGTERM, and SIGKILL after a grace period), and reaps them all,
so no process outlives the call.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import warnings
from dataclasses import replace
from datetime import timedelta
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import LaunchTimeoutError, WorkerFailedError, WorkerFailure
from .fork_server import fork_server_context, STARTING
from .worker import worker_main, WorkerSpec

__all__: List[str] = ["run_workers", "check_start_method"]

# Seconds a worker gets between SIGTERM and SIGKILL.
_TERMINATE_GRACE = 3.0


def run_workers(job: bytes, nprocs: int, world_size: int, first_rank: int, backend: str,
                 master_addr: str, master_port: int, timeout: Optional[float],
                 collective_timeout: Optional[timedelta] = None, reported_timeout: Optional[float] = None,
                 start_method: Optional[str] = None) -> List[Any]:
    """Start the workers and supervise them for ``timeout`` seconds (the launch's ``reported_timeout``
    less what starting the store took)."""
    # Workers give up on the store a little before the launch does, so their error names the store.
    store_deadline = None if timeout is None else time.time() + timeout - min(5.0, 0.2 * timeout)
    procs: List[BaseProcess] = []
    readers: List[Connection] = []
    try:
        with STARTING:
            ctx = _start_context(start_method)
            for local in range(nprocs):
                spec = WorkerSpec(first_rank + local, local, world_size, nprocs, master_addr, master_port,
                                   backend, os.getpid(), store_deadline, collective_timeout, dict(os.environ))
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, args=(spec, job, writer), name=f"distopt-rank{spec.rank}")
                readers.append(reader)
                procs.append(proc)
                try:
                    proc.start()
                finally:
                    # Our copy of the write end must go, or a dead worker's pipe never reports EOF.
                    writer.close()
        return _Supervisor(procs, readers, first_rank).wait(timeout, reported_timeout)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()


def check_start_method(start_method: Optional[str]) -> None:
    """Raise ``ValueError`` unless ``start_method`` is None or a start method this platform has."""
    if start_method is None:
        return
    known = [m for m in ("forkserver", "spawn") if m in mp.get_all_start_methods()]
    if start_method not in known:
        raise ValueError(f"start_method must be one of {known} on this platform, or None for the default, "
                         f"got {start_method!r}")


def _start_context(start_method: Optional[str] = None) -> Any:
    """How workers start: by default from a fork server that imported torch once, where the platform has one.

    A spawned worker imports torch anew (1.5 s of CPU on the development machines, per
    worker and launch, and 1.2 s more for torch._dynamo when it builds its first torch.optim
    optimizer); one forked from the server starts in milliseconds, and is as
    clean as a spawned one: the server is a fresh single-threaded interpreter that has
    only imported modules (nothing runs at import in distopt), never touched CUDA or a
    process group, and started under this process's environment as it is now (it is
    started again when that changed: :mod:`.fork_server`); the worker takes the launch's
    environment and seeds its random generators anew (:mod:`.worker`). The server
    outlives a launch and ends with this process. Where there is no fork server
    (Windows), workers are spawned. Call it with :data:`.fork_server.STARTING` held.
    """
    if start_method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    # torch, torch.distributed and the worker; and torch._dynamo, which the first torch.optim optimizer
    # imports (1.2 s of CPU in each worker otherwise, more than the rest of a small test's work). Only
    # modules: it starts no thread. A module that fails to import here is skipped by multiprocessing.
    return fork_server_context([worker_main.__module__, "torch._dynamo"])


#: Seconds the supervisor blocks at most before looking at signals and the deadline again.
_SLICE = 0.5
#: Seconds the supervisor goes on listening after the first failure, so that the failure that caused
#: it (a peer killed a moment earlier, whose death is reported later) can be named first.
_CAUSE_GRACE = 1.0


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

    def wait(self, timeout: Optional[float], reported_timeout: Optional[float] = None) -> List[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        failures: List[WorkerFailure] = []
        while self.live and not failures:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                running = sorted(self.first_rank + i for i in self.live.values())
                finished = sorted(set(range(self.first_rank, self.first_rank + len(self.procs))) - set(running))
                raise LaunchTimeoutError(reported_timeout or timeout or 0.0, running, finished)
            # A worker that dies without a word died at some point during this wait;
            # dating it to the wait's start ranks it before the errors its death causes in peers.
            since = time.time()
            # Reading pipes as results arrive keeps a large result from blocking its worker's exit.
            # The wait is sliced: a Ctrl-C the kernel hands to another thread (gloo's, a timer's)
            # only sets a flag, which the main thread acts on when its wait returns.
            slice_ = _SLICE if remaining is None else min(remaining, _SLICE)
            for ready in connection.wait(list(self.open_readers) + list(self.live), slice_):
                if ready in self.open_readers:
                    self._receive(self.open_readers[ready])
                else:
                    failures += self._exited(self.live.pop(ready), since)
            failures += [self._failure(i, None, since) for i in self.errors if i in self.live.values()]
        if failures:
            failures += self._more_failures(failures)
            raise WorkerFailedError(self._settle(failures))
        silent = [self.first_rank + i for i, done in enumerate(self.returned) if not done]
        if silent:
            warnings.warn(
                f"worker ranks {silent} exited with code 0 but did not return a value "
                "(sys.exit(0) or os._exit(0) in fn); their results are None",
                stacklevel=4,
            )
        return self.results

    def _more_failures(self, known: List[WorkerFailure]) -> List[WorkerFailure]:
        """Failures that arrive within a moment of the first ones (all workers' ends, when they come).

        A peer that raised because another worker died may report before that death does:
        with the fork server, a death reaches this process through the server.
        """
        more: List[WorkerFailure] = []
        seen = {f.local_rank for f in known}
        deadline = time.monotonic() + _CAUSE_GRACE
        while self.live and time.monotonic() < deadline:
            since = time.time()
            for ready in connection.wait(list(self.open_readers) + list(self.live), deadline - time.monotonic()):
                if ready in self.open_readers:
                    self._receive(self.open_readers[ready])
                else:
                    more += [f for f in self._exited(self.live.pop(ready), since) if f.local_rank not in seen]
            more += [self._failure(i, None, since) for i in self.errors
                     if i in self.live.values() and i not in seen and all(f.local_rank != i for f in more)]
            seen |= {f.local_rank for f in more}
        return more

    def _receive(self, i: int) -> None:
        reader = self.readers[i]
        try:
            message = pickle.loads(reader.recv_bytes())
            if message[0] == "ok":
                message = ("ok", pickle.loads(message[1]))
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
        # A failure caused by a peer's death comes after the failures that could be that death.
        return sorted(unique.values(), key=lambda f: (f.caused_by_a_peer, f.when))


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


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group has no process left."""
    if not hasattr(os, "killpg"):
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member under another user: not ours to end
        pass
    return True


def _stop(procs: Sequence[BaseProcess]) -> None:
    """SIGTERM every live worker and what every worker that did not finish cleanly started,
    SIGKILL what is left after a grace period, and reap all.

    What a worker starts (data-loader workers, a subprocess) is in the worker's process group
    (:func:`.worker.worker_main` makes one). A worker that failed has already exited, but its
    group lives on in its children, orphaned: the group is ended here too. The group's id
    stays the dead worker's pid while any member lives, and the kernel hands that pid to no
    other process meanwhile, so the signal reaches no unrelated process. A worker that
    finished cleanly (exit code 0) is left alone with what it left running, as a spawned
    process's would be.
    """
    started = [proc for proc in procs if proc.pid is not None]
    alive = [proc for proc in started if proc.is_alive()]
    failed = [proc.pid for proc in started if proc not in alive and proc.exitcode != 0]
    for proc in alive:
        _signal_worker(proc, signal.SIGTERM)
    for pgid in failed:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            _signal_worker(proc, signal.SIGKILL)
    # What the workers started gets the rest of the grace period (it is not this process's to wait for).
    groups = [proc.pid for proc in alive] + failed
    while time.monotonic() < deadline and any(_signal_group(pgid, 0) for pgid in groups):
        time.sleep(0.05)
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)
    for proc in started:
        proc.join()
