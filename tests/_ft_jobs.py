"""Fault-tolerant jobs for tests/fault_tolerance: a real torchft lighthouse and replicas as processes.

:class:`Job` starts a lighthouse in the test's process and replicas as processes of
``tests/_scripts/ft_worker.py`` (one replica each: its own TCPStore, a torchft Manager from
``distopt.fault_tolerance.manager.make_manager``, ``DistributedOptimizer(fault_tolerance=manager)``),
and reads their step logs. Import it only after ``pytest.importorskip("torchft")``.

Replicas are forked from a multiprocessing fork server that imported torch, torchft and
distopt once, and run the script as ``__main__`` there: a fresh interpreter would spend about
3 s of CPU importing them, per replica, and these tests start about 40 replicas on a 2-core
machine. The server is single-threaded and has only imported modules, so each replica is as
fresh as a spawned one: its own process, its own TCPStore, Manager and lighthouse client.
"""
from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil
import pytest
from torchft._torchft import LighthouseServer

__all__ = ["Job", "Replica", "recovery", "diloco_kill_and_replace", "job", "LIGHTHOUSE"]

WORKER = Path(__file__).resolve().parent / "_scripts" / "ft_worker.py"
ROOT = Path(__file__).resolve().parents[1]
# Short lighthouse timeouts: a dead replica is dropped 0.3 s after its last heartbeat (it beats every 0.05 s).
LIGHTHOUSE = dict(min_replicas=1, join_timeout_ms=200, quorum_tick_ms=10, heartbeat_timeout_ms=300)


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torchft", "distopt", "distopt.fault_tolerance.manager"]


def _context() -> Any:
    """The fork server's context, the server started (so that it is not taken for a replica left behind)."""
    # torchft's Rust side reads its log level as it loads: set before the server imports it.
    os.environ.setdefault("RUST_LOG", "warn")
    ctx = multiprocessing.get_context("forkserver")
    # A server already started (by distopt.launch in an earlier test of this process) keeps its own
    # preload, which has torch and torch._dynamo: the replicas then import torchft themselves.
    ctx.set_forkserver_preload(_PRELOAD)
    multiprocessing.forkserver.ensure_running()
    return ctx


#: Seconds a forked replica waits before it starts, as a restarted process takes to come up: the tests'
#: replacements start once a death was seen and dropped (as an agent restarts a worker), never within
#: the same quorum, whatever the CPU (a fresh interpreter's imports took 2-4 s here).
START_DELAY = 1.5


def _replica_main(spec: str, err_path: str) -> None:
    """A replica, in the forked process: ft_worker.py as ``__main__``, its stderr to ``err_path``."""
    time.sleep(START_DELAY)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.environ["RUST_LOG"] = "warn"
    sys.argv = [str(WORKER), spec]
    runpy.run_path(str(WORKER), run_name="__main__")


class Replica:
    """A replica's process, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, process: Any) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> Optional[int]:
        return None if self.process.is_alive() else self.process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(WORKER), timeout or 0.0)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)


class Job:
    """A lighthouse and the replicas started so far, with their logs."""

    def __init__(self, tmp: Path, lighthouse: Any = None, **spec: Any) -> None:
        self.tmp = tmp
        self.lighthouse = LighthouseServer(bind="[::]:0", **dict(LIGHTHOUSE, **(lighthouse or {})))
        self.spec = dict(dict(lighthouse=self.lighthouse.address(), pace=0.05), **spec)
        self.procs: Dict[str, Replica] = {}

    def start(self, name: str, replica: int, **extra: Any) -> None:
        spec = dict(self.spec, replica=replica, out=str(self.tmp / f"{name}.jsonl"), **extra)
        process = _context().Process(target=_replica_main, args=(json.dumps(spec), str(self.tmp / f"{name}.err")),
                                     daemon=True, name=f"ft-{name}")
        process.start()
        self.procs[name] = Replica(process)

    def log(self, name: str) -> List[Dict[str, Any]]:
        path = self.tmp / f"{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def steps(self, name: str) -> List[Dict[str, Any]]:
        return [entry for entry in self.log(name) if "digest" in entry]

    def wait_for(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; {self.tails()}")
            time.sleep(0.02)

    def finish(self, timeout: float) -> Dict[str, int]:
        codes = {}
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        self.lighthouse.shutdown()

    def tails(self) -> str:
        return "; ".join(f"{n}: rc={p.poll()} last={self.log(n)[-1:]} err={(self.tmp / f'{n}.err').read_text()[-600:]!r}"
                         for n, p in self.procs.items())

    def check_identical(self) -> Dict[int, str]:
        """Every step's hash is the same on every replica that took it; returns step -> hash."""
        seen: Dict[int, Dict[str, List[str]]] = {}
        for name in self.procs:
            for entry in self.steps(name):
                seen.setdefault(entry["step"], {}).setdefault(entry["digest"], []).append(name)
        differing = {step: hashes for step, hashes in seen.items() if len(hashes) > 1}
        assert not differing, f"replicas differ at steps {differing}"
        return {step: next(iter(hashes)) for step, hashes in seen.items()}


def recovery(job: Job, dead: str, survivor: str) -> float:
    """Seconds from ``dead``'s death to ``survivor``'s next committed step."""
    death = next(entry for entry in job.log(dead) if "dying" in entry)
    after = next(entry for entry in job.steps(survivor) if entry["t"] > death["t"] and entry["step"] > death["step"])
    return after["t"] - death["t"]


def diloco_kill_and_replace(j: Job, *, sync_every: int, kill_step: int, min_syncs: int, **spec: Any) -> Dict[int, str]:
    """DiLoCo, 3 replicas: replica 1 SIGKILLs itself inside a sync's exchange (packs in flight) once all
    three train together; a replacement starts as its agent would. Checks what every such run must show
    (exit codes, every committed sync hashed alike, no survivor restarted or took a sync twice, each
    discarded the broken sync, the replacement bitwise equal at its first sync, the loss below the first
    period's) and returns sync -> hash. ``spec``: the worker's further settings (``compression``, ...)."""
    # Started together (see _kill_and_replace in test_fault_tolerance_modes.py): no quorum of one at start-up.
    j.start("r0", 0, start_together=3, **spec)
    j.start("r1", 1, kill={"step": kill_step, "where": "exchange", "world": 3}, start_together=3, **spec)
    j.start("r2", 2, start_together=3, **spec)
    j.wait_for(lambda: j.procs["r1"].poll() is not None, 40, "replica 1 to die in an exchange")
    j.start("r1b", 1, **spec)
    codes = j.finish(45)
    assert codes == {"r0": 0, "r1": -9, "r2": 0, "r1b": 0}, j.tails()
    hashes = j.check_identical()
    assert len(hashes) >= min_syncs, hashes
    for name in ("r0", "r2"):
        syncs = [e["step"] for e in j.steps(name)]
        assert syncs == sorted(syncs) and len(set(syncs)) == len(syncs), (name, syncs)  # no restart, none twice
        assert j.steps(name)[-1]["discarded"] >= 1, j.steps(name)[-1]  # the sync the kill broke
        # a sync voted down put its parameters back to their anchors (a fragment's, or all of them)
        voted_down = [e["at_anchor"] for e in j.log(name) if "at_anchor" in e]
        assert voted_down and all(n >= 1 for n in voted_down), (name, voted_down)
    first = j.steps("r1b")[0]
    assert first["digest"] == hashes[first["step"]]  # bitwise equal at its first sync
    losses = [e["loss"] for e in j.log("r0") if "loss" in e]
    assert sum(losses[-2 * sync_every:]) / (2 * sync_every) < sum(losses[:sync_every]) / sync_every, losses
    return hashes


@pytest.fixture
def job(tmp_path: Path):
    made: List[Job] = []

    def make(**spec: Any) -> Job:
        made.append(Job(tmp_path, **spec))
        return made[-1]

    _context()  # the fork server outlives the test: started before the processes are counted
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield make
    for j in made:
        j.close()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], f"processes left behind: {left}"
