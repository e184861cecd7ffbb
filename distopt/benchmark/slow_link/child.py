"""One contender on one rank: the process that trains it, forked by the rank's host (:mod:`.host`).

It joins a process group of its own (a fresh TCP store per contender, on rank 0's
address), builds the task's replica and the contender around it, says ``ready``, and
then serves its host's commands until told to stop:

* ``("steps", n, record)``: a barrier, so both ranks start together, then ``n``
  training steps; replies ``("steps", [(seconds, loss, tx_bytes, distopt_bytes), ...])``
  (an empty list when ``record`` is false: warm-up steps). ``tx_bytes`` is what this
  namespace's interfaces sent during the step, headers included
  (``/proc/net/dev``), the same measure for DDP and distopt. With several ranks in a
  namespace (``--ranks-per-host``), which share its counter, it is this rank's share
  of what the namespace sent over the ``n`` steps, from the barrier before them to a
  barrier after them: that count over ``n`` and over the ranks per host. Per step, the
  ranks of one namespace need not be in step (local SGD's are not between two syncs),
  so one rank's step would count another's bytes or miss its own.
* ``("eval",)``: replies ``("eval", loss)``, the mean loss over the task's validation
  batches, of this rank's replica.
* ``("stop",)``: replies ``("stopped",)`` and exits.

Its output goes to a log file of its own: when it dies, the host sends the log's
telling line (gloo's abort message, say) to the supervisor as the reason.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from .contenders import CONTENDERS, ContenderOptions
from .tasks import TASKS

__all__ = ["Job", "contender_main", "interface_tx_bytes", "die_with_parent"]


@dataclass(frozen=True)
class Job:
    """What one contender process does.

    Attributes:
        task: a :data:`~.tasks.TASKS` name.
        contender: a :data:`~.contenders.CONTENDERS` name.
        rank: this process's rank.
        world: the number of ranks.
        master_addr: rank 0's address, where the process group's store listens.
        port: the store's port (one per contender, so no two groups meet).
        seed: seeds the replica and the batches.
        options: the contenders' settings.
        timeout_s: the process group's collective timeout.
        log_path: where this process's stdout and stderr go.
    """

    task: str
    contender: str
    rank: int
    world: int
    master_addr: str
    port: int
    seed: int
    options: ContenderOptions
    timeout_s: float
    log_path: str


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so nothing outlives a killed run."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor's clean-up still ends the processes


def interface_tx_bytes() -> int:
    """Bytes sent so far by this network namespace's interfaces other than loopback.

    ``/proc/net/dev`` lists the interfaces of the reading process's own namespace: in
    the benchmark's, the veth end alone (and ``lo``).
    """
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() != "lo":
                total += int(fields.split()[8])  # after the 8 receive counters: transmitted bytes
    return total


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _steps(job: Job, state: "_State", n: int) -> List[Tuple[float, float, int, Optional[int]]]:
    task, built = TASKS[job.task], state.built
    out = []
    first = interface_tx_bytes()
    for _ in range(n):
        # The batch is ready before the clock starts: a data loader would have it prefetched.
        x, y = task.batch(job.rank, job.world, state.step, job.seed)
        sent = interface_tx_bytes()
        start = time.perf_counter()
        loss = task.loss_fn(built.module(x), y)
        loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        sent = interface_tx_bytes() - sent
        distopt_bytes = (None if built.distopt is None else
                         int(built.distopt.stats.bytes) if built.library_bytes is None else built.library_bytes())
        out.append((seconds, float(loss.item()), sent, distopt_bytes))
        state.step += 1
    if job.options.ranks_per_host > 1:
        dist.barrier()  # every rank of the namespace has sent all it sends in these steps
        share = (interface_tx_bytes() - first) // (job.options.ranks_per_host * n)
        out = [(seconds, loss, share, distopt_bytes) for seconds, loss, _, distopt_bytes in out]
    return out


def _evaluate(job: Job, state: "_State") -> float:
    task = TASKS[job.task]
    if task.val_batches is None:
        return float("nan")
    model = state.model  # the replica itself: DDP's forward would prepare a reduction for nothing
    model.eval()
    with torch.no_grad():
        losses = [float(task.loss_fn(model(x), y)) for x, y in task.val_batches()]
    model.train()
    return sum(losses) / len(losses)


@dataclass
class _State:
    model: torch.nn.Module
    built: Any
    step: int = 0


def contender_main(conn: Connection, job: Job) -> None:
    """The contender process: join the group, build, report, then serve commands (see the module).

    Args:
        conn: the pipe to the rank's host.
        job: what to run.
    """
    die_with_parent()
    _redirect_output(job.log_path)
    torch.set_num_threads(1)  # one core per rank, pinned by the host
    started = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{job.master_addr}:{job.port}", rank=job.rank,
                                world_size=job.world, timeout=timedelta(seconds=job.timeout_s))
    except Exception as exc:  # noqa: BLE001 - any failure is reported, with its type
        conn.send(("error", f"init_process_group failed: {type(exc).__name__}: {exc}"))
        raise SystemExit(1)
    joined = time.perf_counter()
    task, contender = TASKS[job.task], CONTENDERS[job.contender]
    torch.manual_seed(job.seed)  # the same replica in every contender and rank
    model = task.build_model()
    try:
        built = contender.build(model, task.make_optimizer(model.parameters()), job.options)
    except Exception as exc:  # noqa: BLE001 - e.g. an argument this distopt does not take yet
        traceback.print_exc()
        conn.send(("unavailable", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1)
    state = _State(model, built)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # How long joining the group and building took: starting 18 contenders is a visible part of a run.
    info = {"grad_bytes": grad_bytes, "join_s": joined - started, "build_s": time.perf_counter() - joined,
            "pid": os.getpid()}
    if built.distopt is not None:
        info["pack_threshold"] = built.distopt.stats.pack_threshold
    if task.data_id is not None:
        info["data"] = task.data_id()
    conn.send(("ready", info))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "steps":
                dist.barrier()
                records = _steps(job, state, msg[1])
                conn.send(("steps", records if msg[2] else []))
            elif msg[0] == "eval":
                conn.send(("eval", _evaluate(job, state)))
            elif msg[0] == "stop":
                conn.send(("stopped",))
                break
            else:
                raise ValueError(f"unknown command {msg!r}")
    except EOFError:
        return  # the host is gone: nothing to report to
    except Exception as exc:  # noqa: BLE001 - reported as this contender's abort, the others go on
        traceback.print_exc()
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1)
    if built.distopt is not None:
        built.distopt.close()
    dist.destroy_process_group()
