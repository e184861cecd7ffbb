"""A peer gone: a rank that finishes early, crashes or is killed is named, with how it left, and never hangs.

A rank that leaves early makes the others fail with an error that names it and
says that it finished (or crashed, and with what), rather than gloo's "remote
worker crashing", under distopt's launcher and under torchrun; a rank killed
with SIGKILL and no supervisor is named by every survivor within seconds.
Stalls (a rank that is late, not gone): test_stalls.py.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedOptimizer
from distopt._testing import kill_tree, run_torchrun, run_world

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(120)]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def train(opt, model, steps):
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def early_leaver_worker(steps_of):
    rank = dist.get_rank()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        train(opt, model, steps_of[rank])
    except RuntimeError as exc:
        return ("RuntimeError", str(exc))
    return ("ok", None)


def test_a_rank_that_returns_early_is_named_as_finished_not_as_crashed():
    start = time.monotonic()
    results = run_world(early_leaver_worker, 2, [4, 3], timeout=90)
    assert results[1] == ("ok", None)
    kind, text = results[0]
    assert kind == "RuntimeError"
    assert "rank 1 is gone: it finished after step 3" in text, text
    assert "with opt.join()" in text, text
    assert time.monotonic() - start < 30


SCRIPT = Path(__file__).resolve().parents[1] / "_scripts" / "leave_early.py"


HOW_TOLD = {
    "finish": "rank 1 is gone: it finished after step 3",
    "crash": "rank 1 is gone: it crashed (ZeroDivisionError: a bad batch) after step 2",
    "metric": "StallError: rank 0 waited more than 5 s at step 3 for pack 1/1 of the gradient all-reduce; "
              "rank 1 has not arrived: last seen at step 3, before backward. A rank between steps and not in a "
              "collective of this optimizer is busy elsewhere: in a collective of your own (a metric's "
              "all-reduce after its data ran out: wrap the training loop in `with opt.join():`)",
    # Not "finished ... wrap the loop in `with opt.join():`": it exited (status 1) on the error of a call.
    "state_dict": "rank 1 is gone: it exited while it waited for the other ranks in the gathering of the sharded "
                  "state dict (state_dict()) at step 2, on ",
}
# A metric's stall is named by the stall inspector, which sees the group the same way whoever made
# it; a peer's parting words are read alike whether it finished or crashed, so the group made by a plain
# init_process_group is checked with one of them. The snapshot on one rank is the client's script: a plain
# group, with no distopt.shutdown() at exit. Each job is three fresh interpreters.
JOBS = [("finish", "distopt"), ("finish", "plain"), ("crash", "distopt"), ("metric", "distopt"),
        ("state_dict", "plain")]


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory):
    """Every (how, init) job of leave_early.py under torchrun, side by side: ``(how, init) -> (code, output)``.

    Each is a torchrun job of its own; most of each is process start-up and, for ``metric``,
    the 5 s stall timeout, which overlap.
    """
    base = tmp_path_factory.mktemp("leave-early")
    jobs = JOBS
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {job: pool.submit(run_torchrun, SCRIPT, list(job), cwd=_fresh(base / "-".join(job)), timeout=90)
                   for job in jobs}
        return {job: future.result() for job, future in futures.items()}


def _fresh(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("how, init", JOBS)
def test_under_torchrun_the_survivor_is_told_whether_the_peer_finished_or_crashed(how, init, torchrun_jobs):
    code, out = torchrun_jobs[how, init]
    assert code not in (None, 0), out
    seen = [line for line in out.splitlines() if "RANK0 SAW:" in line]
    assert seen, out
    assert HOW_TOLD[how] in seen[0], seen[0]
    if how == "state_dict":
        assert seen[0].endswith("call opt.state_dict() on every rank at the same point (then save it on one rank "
                                "only). See that rank's output for the cause"), seen[0]


KILLED = Path(__file__).resolve().parents[1] / "_scripts" / "killed_peer.py"


def _start_by_hand(script, args, world, cwd):
    """``world`` plain processes with env://, the way a job without a supervising launcher starts."""
    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _run_by_hand(script, args, world, cwd):
    """``script`` on ``world`` ranks started by hand, to its end: ``(procs, their output)``."""
    cwd.mkdir(parents=True)
    procs = _start_by_hand(script, args, world, cwd)
    try:
        return procs, "\n".join(proc.communicate(timeout=90)[0] for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.communicate()


KILLED_INSIDE = Path(__file__).resolve().parents[1] / "_scripts" / "killed_inside.py"
# Where rank 2 of 3 is killed at step 4, and where the survivors last saw it: the collective of its that
# completed last (its own last report, at most a tick old, is from before step 1).
INSIDE = {"backward": "last seen at step 3, in pack 1/1 of the gradient all-reduce, which it took part in",
          "exchange": "last seen at step 4, in pack 1/1 of the gradient all-reduce, which it took part in"}
# The step at which the survivors fail: the parameters of step 4 are waited for at the end of step 4.
FAILED_AT = {"backward": 4, "exchange": 4}
KILLED_BETWEEN_STEPS = [(1, 3, "answers"), (0, 2, "went with it")]  # dead rank, world, what the store does


@pytest.fixture(scope="module")
def jobs_started_by_hand(tmp_path_factory):
    """Every job of killed_peer.py and of killed_inside.py, side by side: ``(script, args) -> (procs, output)``.

    Most of each is process start-up and the wait for the inspector's tick before a kill, which overlap.
    """
    base = tmp_path_factory.mktemp("killed")
    jobs = {**{(KILLED, (str(dead),)): world for dead, world, _ in KILLED_BETWEEN_STEPS},
            **{(KILLED_INSIDE, ("2", where, "4")): 3 for where in INSIDE}}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {job: pool.submit(_run_by_hand, job[0], list(job[1]), world, base / "-".join((job[0].stem,) + job[1]))
                   for job, world in jobs.items()}
        return {job: future.result() for job, future in futures.items()}


@pytest.mark.parametrize("dead, world, store", KILLED_BETWEEN_STEPS)
def test_a_peer_killed_with_sigkill_and_no_supervisor_is_named_by_every_survivor_within_seconds(dead, world, store,
                                                                                                 jobs_started_by_hand):
    procs, text = jobs_started_by_hand[KILLED, (str(dead),)]
    assert procs[dead].returncode == -signal.SIGKILL, text
    killed_at = float(re.search(rf"RANK{dead} KILLED AT ([0-9.]+)", text).group(1))
    host = socket.gethostname()
    for rank in set(range(world)) - {dead}:
        assert procs[rank].returncode == 3, text
        seen = re.search(rf"RANK{rank} SAW AT ([0-9.]+): (.*)", text)
        assert seen, text
        when, message = float(seen.group(1)), seen.group(2)
        assert when - killed_at < 10, message
        assert f"RuntimeError: rank {rank} could not finish pack 1/1 of the gradient all-reduce at step 3: " \
               f"rank {dead} was killed, on {host} (pid {procs[dead].pid})" in message, message
        assert "its process ended without saying how (SIGKILL" in message, message
        if store == "answers":  # where it was comes from the store
            assert re.search(r"last seen at step [23], ", message), message
        else:  # rank 0 hosted the store: its pid, known from the start, is gone
            assert "what it was doing is unknown, since the rendezvous store does not answer either" in message, message
        assert "Connection closed by peer" not in message


@pytest.mark.parametrize("where", INSIDE)
def test_a_rank_killed_inside_a_collective_is_named_with_its_real_last_step_and_the_other_survivor_is_not(
        where, jobs_started_by_hand):
    procs, text = jobs_started_by_hand[KILLED_INSIDE, ("2", where, "4")]
    assert procs[2].returncode == -signal.SIGKILL, text
    for rank, other in ((0, 1), (1, 0)):
        assert procs[rank].returncode == 3, text
        message = re.search(rf"RANK{rank} SAW AT [0-9.]+: (.*)", text).group(1)
        # The killed rank comes first, where it was last seen, and the hint is about it.
        assert re.search(rf"could not finish [^:]* at step {FAILED_AT[where]}: rank 2 was killed, on [^,]+ \(pid {procs[2].pid}\), "
                         + re.escape(INSIDE[where]), message), message
        assert "The other ranks cannot go on without it" in message, message
        # The other survivor, which exits with status 3 after the same failure, is not a cause.
        assert f"rank {other} was killed" not in message and f"rank {other} is gone" not in message, message
        if f"rank {other} " in message:
            assert f"rank {other} failed too, in " in message, message

