"""Fault-tolerant jobs for tests/fault_tolerance: a real torchft lighthouse and replicas as processes.

:class:`Job` starts a lighthouse in the test's process and replicas as processes of
``tests/_scripts/ft_worker.py`` (one replica each: its own TCPStore, a torchft Manager from
``distopt.fault_tolerance.manager.make_manager``, ``DistributedOptimizer(fault_tolerance=manager)``),
and reads their step logs. Import it only after ``pytest.importorskip("torchft")``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import psutil
import pytest
from torchft._torchft import LighthouseServer

__all__ = ["Job", "recovery", "job", "LIGHTHOUSE"]

WORKER = Path(__file__).resolve().parent / "_scripts" / "ft_worker.py"
ROOT = Path(__file__).resolve().parents[1]
# Short lighthouse timeouts: a dead replica is dropped 0.3 s after its last heartbeat (it beats every 0.05 s).
LIGHTHOUSE = dict(min_replicas=1, join_timeout_ms=200, quorum_tick_ms=10, heartbeat_timeout_ms=300)


class Job:
    """A lighthouse and the replicas started so far, with their logs."""

    def __init__(self, tmp: Path, lighthouse: Any = None, **spec: Any) -> None:
        self.tmp = tmp
        self.lighthouse = LighthouseServer(bind="[::]:0", **dict(LIGHTHOUSE, **(lighthouse or {})))
        self.spec = dict(dict(lighthouse=self.lighthouse.address(), pace=0.05), **spec)
        self.procs: Dict[str, subprocess.Popen] = {}

    def start(self, name: str, replica: int, **extra: Any) -> None:
        spec = dict(self.spec, replica=replica, out=str(self.tmp / f"{name}.jsonl"), **extra)
        env = dict(os.environ, RUST_LOG="warn", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.procs[name] = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"{name}.err", "w"))

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


@pytest.fixture
def job(tmp_path: Path):
    made: List[Job] = []

    def make(**spec: Any) -> Job:
        made.append(Job(tmp_path, **spec))
        return made[-1]

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield make
    for j in made:
        j.close()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], f"processes left behind: {left}"
