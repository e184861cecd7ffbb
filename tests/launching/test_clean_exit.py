"""Every process exits cleanly: nothing distopt sets up keeps a process group alive past shutdown()."""
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distopt
from distopt._testing import run_torchrun, run_world

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "_scripts" / "exit_after_training.py"
# An abort at exit hit about one run in two before the fix; its cause (the group outliving shutdown())
# now fails every run, since the script turns shutdown()'s warning about it into an error.
RUNS = 2
RUN_TIMEOUT = 60


def _gloo_threads_after_shutdown(build_optimizer_first: bool):
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    if build_optimizer_first:
        # The first torch.optim optimizer imports torch.distributed.nn.functional (through torch._dynamo).
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distopt.shutdown()
    return group() is None, [str(w.message) for w in caught]


@pytest.mark.timeout(120)
def test_shutdown_frees_the_group_after_an_optimizer_was_built():
    for freed, caught in run_world(_gloo_threads_after_shutdown, 2, True, timeout=90):
        assert freed and caught == []


def _hold_group_then_shutdown():
    held = dist.group.WORLD  # noqa: F841  (a user's own reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distopt.shutdown()
    return [(w.category.__name__, str(w.message)) for w in caught]


@pytest.mark.timeout(120)
def test_shutdown_warns_when_something_keeps_the_group_alive():
    for caught in run_world(_hold_group_then_shutdown, 2, timeout=90):
        assert len(caught) == 1, caught
        category, message = caught[0]
        assert category == "RuntimeWarning"
        assert "still references one" in message and "can abort the process at exit" in message
        assert "Drop your own references" in message


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_the_job_that_aborted_at_exit_exits_zero_every_time(tmp_path):
    # The runs are independent jobs (torchrun --standalone: a port each), so they run side by side:
    # most of a run is process start-up and exit, which overlap.
    with ThreadPoolExecutor(RUNS) as pool:
        runs = list(pool.map(lambda _: run_torchrun(SCRIPT, [], tmp_path, RUN_TIMEOUT), range(RUNS)))
    for run, (code, out) in enumerate(runs):
        assert code is not None, f"run {run + 1} did not finish in {RUN_TIMEOUT} s:\n{out}"
        assert code == 0, f"run {run + 1} of {RUNS} exited with {code}:\n{out}"
