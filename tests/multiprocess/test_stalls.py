"""Stalls: the waiting ranks say who is missing and where it was, and never hang.

A rank that sleeps inside its step makes the others wait; the stall warning
names it and its step within the configured time plus a tick or two, and with
``stall_timeout`` every waiting rank raises :class:`distopt.StallError` with
the same text. A collective that one rank alone makes is named as mismatched
collectives, not a slow link. Ranks that leave or die: test_peer_gone.py.
"""
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DiLoCo, DistributedOptimizer, LocalSGD, StallError
from distopt._testing import run_world
from distopt.engine.in_flight import Broadcasts
from distopt.transport.stalls import Progress
from distopt.transport.waiting import wait_for

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(120)]


class LateWork:
    """A work that completes (or fails) in the instant after a wait with a timeout runs out."""

    def __init__(self, error=None):
        self.error = error
        self.done = False

    def wait(self, timeout=None):
        if timeout is not None and not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        return self.done


def _progress():
    return Progress(group="g", ranks=[0, 1], rank=0, warn_after=None, raise_after=None)


def test_a_collective_that_completes_as_a_wait_slice_runs_out_is_done_not_a_stall():
    assert wait_for(LateWork(), False, _progress(), 1, "pack 1/1", time.perf_counter() + 0.01)
    broadcasts = Broadcasts([LateWork(), LateWork()])
    assert broadcasts.wait(timedelta(seconds=0.01)) and broadcasts.is_completed()


def test_a_collective_that_failed_as_a_wait_slice_ran_out_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:
        wait_for(LateWork("Connection closed by peer"), False, _progress(), 1, "pack 1/1", time.perf_counter() + 0.01)
    assert not isinstance(info.value, StallError)
    broadcasts = Broadcasts([LateWork(), LateWork("Connection closed by peer")])
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        broadcasts.wait(timedelta(seconds=0.01))
    assert broadcasts.is_completed()  # the failure is what the wait explains


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append((time.monotonic(), record.getMessage()))


def train(opt, model, steps):
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def sleeper_worker(sleepy, sleep, warning, timeout, steps=5):
    """Rank ``sleepy`` sleeps inside its third step; every rank reports what it saw and when."""
    rank = dist.get_rank()
    captured = Captured()
    logging.getLogger("distopt").addHandler(captured)
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stall_warning=warning,
                               stall_timeout=timeout)
    if rank == sleepy:
        opt.register_step_pre_hook(lambda *_: time.sleep(sleep) if opt._engine.steps == 2 else None)
    start = time.monotonic()
    outcome = ("ok", None, None)
    try:
        train(opt, model, steps)
    except StallError as exc:
        outcome = ("StallError", str(exc), time.monotonic() - start)
    except RuntimeError as exc:
        outcome = ("RuntimeError", str(exc), time.monotonic() - start)
    finally:
        logging.getLogger("distopt").removeHandler(captured)
    warnings = [(t - start, message) for t, message in captured.records]
    return {"outcome": outcome, "warnings": warnings, "elapsed": time.monotonic() - start}


@pytest.fixture(scope="module")
def worlds():
    """The worlds of the tests below, side by side, since each spends seconds idle waiting for a stall to be
    warned about or to time out: name -> its per-rank results, as a done Future."""
    launches = {
        # rank 1 sleeps 5 s in its third step; a warning after 2 s, no timeout (each sleep lasts at
        # least to the end of the window its test accepts the warning or the error in)
        "warned": (sleeper_worker, 2, (1, 5.0, 2.0, None)),
        # rank 1 of 3 sleeps 6 s in its third step; a warning after 1 s, a timeout after 3 s
        "timed out": (sleeper_worker, 3, (1, 6.0, 1.0, 3.0)),
        "add_param_group": (one_rank_call_worker, 2, ("add_param_group",)),
        "broadcast_parameters": (one_rank_call_worker, 2, ("broadcast_parameters",)),
        "add_param_group after a rank joined": (add_param_group_after_a_rank_joined_worker, 2, (False,)),
        "add_param_group after a rank joined, streaming": (add_param_group_after_a_rank_joined_worker, 2, (True,)),
    }
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {name: pool.submit(run_world, fn, world, *args, timeout=90)
                   for name, (fn, world, args) in launches.items()}
    return futures


def test_a_stalled_rank_is_named_with_its_step_and_phase_within_the_warning_time(worlds):
    results = worlds["warned"].result()
    waiting, sleeper = results
    assert waiting["outcome"][0] == "ok" and sleeper["outcome"][0] == "ok", results
    assert sleeper["warnings"] == []
    (when, message), = waiting["warnings"]
    assert 2.0 <= when <= 2.0 + 3.0, waiting["warnings"]
    assert re.search(r"rank 0 has waited [23] s at step 3 for pack 1/1 of the gradient all-reduce", message), message
    assert "rank 1 has not arrived: last seen at step 2, inside step()" in message, message


def test_with_a_stall_timeout_every_waiting_rank_raises_the_same_stall_error(worlds):
    results = worlds["timed out"].result()
    waiting = [results[0], results[2]]
    for result in waiting:
        kind, text, when = result["outcome"]
        assert kind == "StallError", result
        assert 3.0 <= when <= 3.0 + 3.0, result
    texts = {r["outcome"][1] for r in results}
    assert len(texts) == 1, texts  # the sleeper meets the same error when it wakes
    text = texts.pop()
    assert "ranks 0, 2 waited more than 3 s at step 3 for pack 1/1 of the gradient all-reduce" in text, text
    assert "rank 1 has not arrived: last seen at step 2, inside step()" in text, text


def one_rank_call_worker(call):
    """Rank 0 alone makes a call that communicates, before its second step."""
    rank = dist.get_rank()
    model = make_model()
    head = nn.Linear(2, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stall_timeout=3.0)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    try:
        for step in range(3):
            if step == 1 and rank == 0:
                if call == "add_param_group":
                    opt.add_param_group({"params": list(head.parameters())})
                else:
                    opt.broadcast_parameters()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    except StallError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize("call, where", [("add_param_group", "the check that every rank built the same optimizer"),
                                         ("broadcast_parameters", "the parameter broadcast")])
def test_a_call_made_on_one_rank_only_is_named_as_mismatched_collectives_not_a_slow_link(call, where, worlds):
    texts = worlds[call].result()
    assert len(set(texts)) == 1, texts
    assert f"the ranks are in different collectives of this optimizer, paired with each other (rank 0 in {where}; " \
           "rank 1 in pack 1/1 of the gradient all-reduce)" in texts[0], texts[0]
    assert "slow to arrive" not in texts[0]


def add_param_group_after_a_rank_joined_worker(streaming):
    """Inside a join block of local SGD (every=2; or streaming DiLoCo, whose last round of a rank leaving merges
    fragments, in phases of their own), rank 1 runs out after 2 steps; rank 0 adds a group at the top of its 4th
    step, between two syncs, where no round has told it that rank 1 joined: its check meets rank 1's last round
    (docs/failures.md, "Uneven inputs": it stalls)."""
    rank = dist.get_rank()
    model, head = make_model(), nn.Linear(2, 2)
    mode = (DiLoCo(every=4, outer=lambda ps: torch.optim.SGD(ps, lr=0.7), fragments=2, overlap=1) if streaming
            else LocalSGD(every=2))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode=mode, stall_timeout=3.0)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    try:
        with opt.join():
            for step in range([5, 2][rank]):
                if step == 3:
                    opt.add_param_group({"params": list(head.parameters())})
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    except StallError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize("name, joined_in", [
    ("add_param_group after a rank joined", "pack 1/1 of the gradient all-reduce"),
    ("add_param_group after a rank joined, streaming", "pack 1/2 of the parameter exchange (local SGD)")])
def test_a_call_inside_a_join_block_that_meets_a_joined_ranks_round_names_the_joined_rank_not_a_call_on_some_ranks(
        name, joined_in, worlds):
    # The stall said that add_param_group() was called on some ranks only, though every rank still training called
    # it: the rank in the other collective is the one that ran out of data, which cannot take part.
    texts = worlds[name].result()
    assert len(set(texts)) == 1, texts
    text = texts[0]
    assert f"(rank 0 in the check that every rank built the same optimizer; rank 1 in {joined_in}): rank 1 ran out " \
           "of data inside `with opt.join():` and is waiting in the join" in text, text
    assert "make it after the block" in text and "on some ranks only" not in text, text
