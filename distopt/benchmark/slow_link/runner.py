"""Runs a slow-link benchmark: builds the link, starts the hosts, runs every task's contenders, cleans up.

For each task the contenders are started one after another (distopt's
``pack_threshold="auto"`` times the link while it is built, which another
contender's traffic would disturb), warmed up, then run in interleaved rounds: in
each round every contender runs ``chunk`` steps in turn, in an order rotated by one
each round, so that whatever else the machine does hits all of them alike. A
contender's time is the sum of its own steps; the others wait meanwhile. A
contender that fails (it aborts, raises or hangs) is ended on both ranks and
reported with its reason and the steps it had done; the others go on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from .child import Job
from .config import LinkConfig
from .contenders import CONTENDERS
from .namespaces import ShapedLink, check_can_build, sweep_stale
from .results import ContenderRun, TaskResult, choose_target, merge_ranks
from .supervisor import FAILURES, Supervisor, describe_failure
from .tasks import TASKS, LinkTask

__all__ = ["run_link_benchmark", "pick_cores", "failure_of"]

Log = Callable[[str], None]


@contextlib.contextmanager
def _exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit (as Ctrl-C raises KeyboardInterrupt), so clean-up runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def pick_cores(ranks_per_host: int = 1) -> List[int]:
    """The core of each rank of two hosts of ``ranks_per_host``: a core of its own among those this process
    may run on, round them where there are fewer (the same one twice on a single core; on two cores, 2 x 2
    ranks put one rank of each host on each core)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return [cores[rank % len(cores)] for rank in range(2 * ranks_per_host)]


def failure_of(replies: Sequence[Tuple[Any, ...]]) -> Tuple[str, str]:
    """``(status, reason)`` of a contender from its ranks' replies, at least one of which failed.

    The reason names the rank that failed first in kind: a construction that raised
    (``unavailable``), a process killed by a signal other than the supervisor's SIGKILL
    (gloo's abort), an exception, another exit, a hang; a peer the supervisor killed
    after that is not the reason.

    Args:
        replies: one reply per rank.

    Returns:
        The status (``"unavailable"``, ``"aborted"`` or ``"hung"``) and the reason.
    """
    def rank_of(reply: Tuple[Any, ...]) -> int:
        kind = reply[0]
        if kind == "unavailable":
            return 0
        if kind == "gone" and reply[1] is not None and reply[1] < 0 and reply[1] != -signal.SIGKILL:
            return 1
        if kind == "error":
            return 2
        if kind == "gone" and reply[1] != -signal.SIGKILL:
            return 3
        if kind == "hung":
            return 4
        return 5  # killed by the supervisor, or not a failure

    failed = [(rank_of(reply), rank, reply) for rank, reply in enumerate(replies) if reply[0] in FAILURES]
    if not failed:
        raise ValueError(f"no reply of {list(replies)!r} is a failure")
    order, rank, reply = min(failed, key=lambda f: f[:2])
    status = "unavailable" if reply[0] == "unavailable" else "hung" if reply[0] == "hung" else "aborted"
    return status, f"rank {rank}: {describe_failure(reply)}"


def _start(sup: Supervisor, task: LinkTask, cfg: LinkConfig, index: int, log_dir: Path, log: Log,
           runs: Dict[str, ContenderRun]) -> List[str]:
    live = []
    master = sup.link.hosts[0].address
    options = dataclasses.replace(cfg.options, ranks_per_host=cfg.ranks_per_host)
    for i, name in enumerate(cfg.contenders):
        key = f"{task.name}/{name}"
        jobs = [Job(task.name, name, rank, sup.world, master, cfg.base_port + 100 * index + i, cfg.seed, options,
                    cfg.collective_timeout_s(), str(log_dir / f"{task.name}-{name}-rank{rank}.log"))
                for rank in range(sup.world)]
        replies = sup.start_contender(key, jobs, cfg.step_deadline_s(1) + 60)
        if all(reply[0] == "ready" for reply in replies):
            runs[name].info = dict(replies[0][1])
            live.append(name)
        else:
            runs[name].fail(*failure_of(replies))
            sup.kill(key)
            log(f"{task.name}: {name} {runs[name].status}: {runs[name].reason}")
    return live


def _run_steps(sup: Supervisor, key: str, run: ContenderRun, steps: int, record: bool, cfg: LinkConfig,
               log: Log) -> None:
    first = len(run.step_ms) + 1
    replies = sup.request(key, ("steps", steps, record), cfg.step_deadline_s(steps))
    if all(reply[0] == "steps" for reply in replies):
        if record:
            run.add(merge_ranks([reply[1] for reply in replies]))
        return
    status, reason = failure_of(replies)
    where = f"in steps {first}-{first + steps - 1}" if record else "in its warm-up"
    run.fail(status, f"{where}: {reason}")
    sup.kill(key)
    log(f"{key} {status} {where}: {reason}")


def run_task(sup: Supervisor, task: LinkTask, cfg: LinkConfig, index: int, log_dir: Path, log: Log) -> TaskResult:
    """Every contender of ``cfg`` on ``task``: started, warmed up, interleaved, evaluated, stopped.

    Args:
        sup: the running hosts.
        task: what to train.
        cfg: the run.
        index: the task's position in the run (its contenders' ports follow from it).
        log_dir: where the contenders' logs go.
        log: receives progress lines.

    Returns:
        The task's figures.
    """
    schedule = task.schedule(cfg.quick)
    if cfg.rounds is not None:
        schedule = dataclasses.replace(schedule, rounds=cfg.rounds)
    runs = {name: ContenderRun(name, CONTENDERS[name].description, CONTENDERS[name].baseline)
            for name in cfg.contenders}
    started = time.perf_counter()
    live = _start(sup, task, cfg, index, log_dir, log, runs)
    log(f"{task.name}: started {len(live)} of {len(cfg.contenders)} contenders "
        f"in {time.perf_counter() - started:.0f} s")
    if schedule.warmup:
        started = time.perf_counter()
        for name in live:
            _run_steps(sup, f"{task.name}/{name}", runs[name], schedule.warmup, False, cfg, log)
        log(f"{task.name}: warmed up ({schedule.warmup} steps each) in {time.perf_counter() - started:.0f} s")
    for r in range(schedule.rounds):
        started = time.perf_counter()
        # Rotated by one each round: no contender always runs right after the same other one.
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for name in order:
            if runs[name].ok:
                _run_steps(sup, f"{task.name}/{name}", runs[name], schedule.chunk, True, cfg, log)
        if schedule.eval_every and (r + 1) % schedule.eval_every == 0:
            for name in live:
                if runs[name].ok:
                    replies = sup.request(f"{task.name}/{name}", ("eval",), 300)
                    if all(reply[0] == "eval" for reply in replies):
                        runs[name].evals.append((len(runs[name].step_ms), sum(r[1] for r in replies) / len(replies)))
                    else:
                        runs[name].fail(*failure_of(replies))
                        sup.kill(f"{task.name}/{name}")
        log(f"{task.name}: round {r + 1}/{schedule.rounds} ({schedule.chunk} steps each) "
            f"in {time.perf_counter() - started:.0f} s")
    for name in live:
        key = f"{task.name}/{name}"
        if runs[name].ok:
            sup.request(key, ("stop",), 60)
        sup.kill(key)  # waits until both processes are gone, whatever the stop did
    target = choose_target(runs, schedule.steps) if task.real else None
    return TaskResult(task.name, task.description, task.real,
                      {"warmup": schedule.warmup, "rounds": schedule.rounds, "chunk": schedule.chunk,
                       "eval_every": schedule.eval_every, "steps": schedule.steps}, runs, target)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_link_benchmark(cfg: LinkConfig, log: Log = lambda line: None) -> Dict[str, Any]:
    """Build the shaped link, run every task of ``cfg`` over it, and remove everything again.

    Args:
        cfg: what to run.
        log: receives one line per phase (progress for people).

    Returns:
        ``{"config", "environment", "link", "tasks": [TaskResult]}``.

    Raises:
        LinkUnavailableError: not root, no ``ip``/``tc``, or the link could not be built.
        HostError: a rank's host process died.
    """
    check_can_build()
    swept = sweep_stale()
    if swept:
        log(f"removed namespaces left by killed runs: {', '.join(swept)}")
    cores = pick_cores(cfg.ranks_per_host)
    environment = {"torch": torch.__version__, "python": platform.python_version(), "kernel": platform.release(),
                   "cpu": _cpu_model(), "cores": cores, "load_before": os.getloadavg()}
    started = time.perf_counter()
    with _exit_on_signals(), ShapedLink(cfg.rate_bps) as link, \
            tempfile.TemporaryDirectory(prefix="distopt-link-") as tmp, \
            Supervisor(link, cores, Path(tmp), cfg.ranks_per_host) as sup:
        log(f"link built: {link.tbf.describe()} on {link.hosts[0].interface} and {link.hosts[1].interface}; "
            f"ranks pinned to cores {cores}")
        # Both directions, one after the other, on ports below the contenders': rank 0 and the other host's first.
        other = cfg.ranks_per_host
        probe = [sup.probe(other, 0, cfg.base_port - 2, cfg.probe_bytes),
                 sup.probe(0, other, cfg.base_port - 1, cfg.probe_bytes)]
        log(f"link check: {probe[0]['mbit_s']:.1f} and {probe[1]['mbit_s']:.1f} Mbit/s of TCP payload")
        tasks = [run_task(sup, TASKS[name], cfg, i, Path(tmp), log) for i, name in enumerate(cfg.tasks)]
        link_info = {"rate_bps": cfg.rate_bps, "tbf": link.tbf.tc_args(), "tbf_text": link.tbf.describe(),
                     "namespaces": [h.namespace for h in link.hosts], "probe_bytes": cfg.probe_bytes,
                     "probe": {"b_to_a": probe[0], "a_to_b": probe[1]}}
    environment["load_after"] = os.getloadavg()
    environment["seconds"] = time.perf_counter() - started
    return {"config": {"rate_bps": cfg.rate_bps, "tasks": list(cfg.tasks), "contenders": list(cfg.contenders),
                       "powersgd_rank": cfg.options.powersgd_rank, "quick": cfg.quick, "seed": cfg.seed,
                       "ranks_per_host": cfg.ranks_per_host},
            "environment": environment, "link": link_info, "tasks": tasks}
