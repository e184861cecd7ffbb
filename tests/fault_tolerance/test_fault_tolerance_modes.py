"""Fault tolerance with compression and join(), on real processes, real gloo and a real lighthouse.

Replicas are processes of ``tests/_scripts/ft_worker.py`` (see ``tests/_ft_jobs.py``). What is
checked: a compressed step discarded because a replica died leaves every survivor where it was
(compressor state included), the survivors stay bitwise identical, a replacement heals and is
bitwise equal after its first step; under ``join()`` the mean is over the replicas that
contributed to each committed step, a replica that ran out of data shadows the others, and every
replica leaves the block with the same state. Skipped, with the reason, where torchft is not
installed (``pip install -e ".[ft]"``).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse below runs in this process: no INFO line per quorum
torchft = pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[ft]' (torchft==0.2.0)")
psutil = pytest.importorskip("psutil")
import torch  # noqa: E402

from _ft_jobs import Job, job, recovery  # noqa: E402,F401  (job is a fixture)


def _kill_and_replace(j: Job, compression: str, steps: int) -> Dict[int, str]:
    """Three replicas; replica 1 SIGKILLs itself inside backward (packs in flight) once all three train
    together; a replacement starts as its agent would. Checks what every such run must show and
    returns step -> hash."""
    j.start("r0", 0, compression=compression)
    j.start("r1", 1, compression=compression, kill={"step": 5, "where": "backward", "world": 3})
    j.start("r2", 2, compression=compression)
    j.wait_for(lambda: j.procs["r1"].poll() is not None, 30, "replica 1 to die inside backward")
    j.start("r1b", 1, compression=compression)
    codes = j.finish(40)
    assert codes == {"r0": 0, "r1": -9, "r2": 0, "r1b": 0}, j.tails()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert j.log("r0")[0]["distopt"].startswith(os.path.join(here, "distopt")), j.log("r0")[0]  # this tree's distopt
    hashes = j.check_identical()  # parameters, Adam's state (and PowerSGD's Q) alike at every step
    for name in ("r0", "r2"):
        steps_seen = [e["step"] for e in j.steps(name)]
        assert steps_seen == sorted(steps_seen), (name, steps_seen)  # no restart, never back
        assert sorted(set(steps_seen)) == list(range(steps_seen[0], steps_seen[-1] + 1)), "a committed step is missing"
    discarded = [e for e in j.steps("r0") if not e["ok"]]
    assert 1 <= j.steps("r0")[-1]["discarded"] <= 3 and discarded, j.steps("r0")[-1]  # the step the kill broke
    # The next quorum named the replica that was missing, in the stall inspector's words.
    named = [e for name in ("r0", "r2") for e in j.steps(name) if e["missing"]]
    assert named and all(e["missing"] == [1] for e in named), named
    assert "replica 1 stopped answering" in named[0]["last_failure"], named[0]
    done = j.log("r1b")[-1]
    assert done.get("done") and done["heals"] >= 1, done
    first = j.steps("r1b")[0]
    assert first["digest"] == hashes[first["step"]]  # bitwise equal after its first step
    losses = [e["loss"] for e in j.steps("r0")]
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses
    return hashes


@pytest.mark.timeout(60)
def test_int8_a_kill_inside_the_all_to_all_and_a_replacement_that_heals(job: Any, capsys: Any) -> None:
    """int8 (per pack an all-to-all then an all-gather, several packs): replica 1 is SIGKILLed inside
    backward with packs in flight. The survivors discard that step alike, their residuals go back
    to where they were (so they go on bitwise identical), the loss falls, and the replacement heals
    (residuals empty, the others' parameters and Adam state) and is bitwise equal at its first step."""
    j = job(steps=14, until_world=3, streak=3, pace=0.02)
    _kill_and_replace(j, "int8", 14)
    with capsys.disabled():
        print(f"\n  fault tolerance, int8: next commit {recovery(j, 'r1', 'r0'):.3f} s after a kill inside backward")
