"""One worker of :func:`~distopt.launching.launch`: from process start to its report.

:func:`worker_main` is the target of every worker process; it must stay at
module level so that the start methods (the fork server's, or ``spawn``) can
find it by name. A worker ties its life to the launching process, takes the
launching process's environment and torchrun's ``env://`` variables (the only
environment variables it writes), seeds its random generators anew, joins the process group through the
parent's rendezvous store, runs the job and sends its result, or its traceback,
back through a pipe. The job's format is defined here too, by
:func:`pickle_job`, next to the code that reads it.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..transport import stalls
from .interface import pick_interface
from .lifecycle import init_default_group, uses_cuda, shutdown

__all__: List[str] = ["STORE_TIMEOUT", "WorkerSpec", "pickle_job", "worker_main"]

# How long a worker waits to reach the parent's rendezvous store.
STORE_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    parent_pid: int
    store_deadline: Optional[float]  # time.time() by which the store must answer
    collective_timeout: Optional[timedelta]
    environ: Dict[str, str]  # the launching process's environment when it launched


def _die_with_parent(launcher_pid: int) -> None:
    """Make the kernel kill this worker if its parent dies, so none is orphaned.

    The parent is the launching process, or the fork server it started, which ends
    when the launching process does (so the worker goes then too).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # 1 == PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:  # the launching process died before prctl took effect
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:  # alive, under another user (cannot happen for our own parent, but harmless)
        pass


def _reseed() -> None:
    """Seed the global random generators from fresh OS randomness, as a new interpreter seeds them.

    A worker forked from the fork server starts with a copy of the server's generators, the same
    in every worker and in every launch: unseeded initialisation, dropout masks, shuffles and
    augmentation would repeat on every rank. torch's default CPU generator and numpy's global
    RandomState (when the server imported numpy; a worker that imports it later seeds it anew)
    are reseeded as a fresh interpreter seeds them, and Python's ``random`` too (CPython reseeds
    it after a fork already). CUDA's generators are left alone: the server never touched CUDA,
    so they are made in the worker when it first uses CUDA, as in a new process.
    """
    torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    random.seed()


def pickle_job(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *, unwrap: bool) -> bytes:
    """Pickle what a worker runs, or say why it cannot be sent to the workers.

    Args:
        fn: the function the workers run, pickled by reference (module and name).
        args: its positional arguments.
        kwargs: its keyword arguments.
        unwrap: ``fn`` is a wrapper made by :func:`~distopt.launching.launcher`,
            which pickles by name in its place; the worker calls the function it
            wraps, since calling the wrapper would launch again.

    Raises:
        TypeError: ``fn`` or an argument cannot be pickled.
    """
    try:
        return pickle.dumps((fn, unwrap, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise TypeError(
            f"launch could not pickle fn={getattr(fn, '__qualname__', fn)!r} with its args/kwargs for the "
            "spawned workers: define fn at module level (not a lambda or a nested function) and pass "
            f"picklable arguments. Pickle said: {exc}"
        ) from exc


def worker_main(spec: WorkerSpec, job: bytes, conn: Connection) -> None:
    """Entry point of a spawned worker: set up the group, run the job, report back."""
    _die_with_parent(spec.parent_pid)
    # A worker forked from the fork server has the server's environment, from when it started;
    # take the launching process's, as a spawned worker would have.
    os.environ.clear()
    os.environ.update(spec.environ)
    _reseed()
    _send(conn, ("started",))
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
        fn, unwrap, args, kwargs = pickle.loads(job)
        if unwrap:
            fn = fn.__wrapped__
        if uses_cuda(spec.backend):
            torch.cuda.set_device(spec.local_rank)
        # Like torchrun, share the cores between the local workers: N workers each running as
        # many intra-op threads as there are cores oversubscribe the CPU and slow every op.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // spec.local_world_size))
        pick_interface(spec.master_addr, announce=spec.local_rank == 0)
        store = _connect(spec)
        init_default_group(backend=spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=spec.collective_timeout)
        # A rank returns from init while others may still be connecting to it; one collective first,
        # so that a rank whose fn ends at once cannot close its connections under their set-up.
        dist.all_reduce(torch.zeros(1, device="cuda" if spec.backend == "nccl" else "cpu"))
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        else:
            _send(conn, ("ok", _pickle_result(result, spec.rank)))
        del fn, args, kwargs  # so that nothing of the job keeps the group alive past shutdown()
        shutdown()
    except BaseException as exc:
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        stalls.mark_exit(stalls.ending(exc))
        _report_and_exit(conn, traceback.format_exc(), code)
    conn.close()


def _connect(spec: WorkerSpec) -> Any:
    """A client of the rendezvous store (node 0's launching process owns it, so port 0 never races)."""
    seconds = STORE_TIMEOUT.total_seconds()
    if spec.store_deadline is not None:
        # torch's client tries twice, each time for the whole timeout (4.4 s took 9-10 s): a third of
        # what is left keeps both tries, the report and the reaping inside the launch's timeout.
        seconds = max(min((spec.store_deadline - time.time()) / 3, seconds), 0.5)
    start = time.monotonic()
    try:
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timedelta(seconds=seconds))
    except Exception as exc:
        raise RuntimeError(
            f"rank {spec.rank} could not reach the rendezvous store at {spec.master_addr}:{spec.master_port} within "
            f"{time.monotonic() - start:.1f} s: is node 0 running launch(..., node_rank=0) with the same master_addr "
            "and master_port, and can this machine reach that port?"
        ) from exc


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle, as bytes: the Connection's own pickler (torch registers reductions on it) would
    # send a tensor as a handle on this process's shared memory, which is gone once this worker exits.
    conn.send_bytes(pickle.dumps(message))


def _pickle_result(result: Any, rank: int) -> bytes:
    """``result`` as plain-pickle bytes (tensors travel by value).

    Raises:
        TypeError: it cannot be pickled; names the rank and the type.
    """
    try:
        return pickle.dumps(result)
    except Exception as exc:
        raise TypeError(
            f"rank {rank}: fn returned a {type(result).__name__}, which cannot be pickled to send it to the "
            f"launching process ({exc}); return plain data (tensors, numbers, lists, dicts), or save the "
            "object to a file and return its path"
        ) from exc


def _report_and_exit(conn: Connection, formatted: str, code: int) -> None:
    try:
        _send(conn, ("error", time.time(), formatted))
        conn.close()
    except BaseException:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a peer may be stuck in a collective with us.
    os._exit(code)
