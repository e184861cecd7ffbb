"""What the stall inspector's errors say, from the positions in the store alone (no processes).

A peer killed on another host shows only as a position that stops changing: the
survivor must wait past the silence threshold before it gives up on naming it. A peer
killed on this host is named at once, from its pid, even when the store went with it.
Inside a join block, the hints say what fits a block, never to wrap the loop in one.
"""
import json
import re
import subprocess
import sys
import threading
import time

import pytest

from distopt.planning.control import Totals
from distopt.transport import stalls
from distopt.transport.stalls import Progress

LOST = RuntimeError("[pair.cc:553] Connection reset by peer [10.0.0.2]:4284")


class Store:
    """A store holding one published position per rank; ``gone=True``: its host died."""

    def __init__(self, positions, gone=False):
        self.positions = positions
        self.gone = gone

    def _rank(self, key):
        tail = key.rsplit("/", 2)
        return None if tail[-2] == "stall" else int(tail[-1])

    def check(self, keys):
        if self.gone:
            raise RuntimeError("Broken pipe")
        return all(self._rank(k) in self.positions for k in keys)

    def get(self, key):
        return self.positions[self._rank(key)]


def _position(rank, step, phase, in_join=False, **identity):
    progress = Progress(group="g", ranks=[0, 1], rank=rank, warn_after=None, raise_after=None, step=step, phase=phase,
                        in_join=in_join)
    return json.dumps(dict(json.loads(progress.payload()), **identity)).encode()


def _survivor(in_join=False):
    return Progress(group="g", ranks=[0, 1], rank=0, warn_after=None, raise_after=None, step=3, in_join=in_join)


def _ended_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_peer_killed_on_another_host_is_named_once_its_position_is_older_than_the_silence_threshold(monkeypatch):
    monkeypatch.setattr(stalls, "TICK", 0.05)  # silence threshold: 5 ticks, 0.25 s
    store = Store({1: _position(1, 3, "backward", host="node7", pid=4242, space="node7/other")})
    start = time.monotonic()
    error = stalls.translate(_survivor(), 5, "pack 1/1 of the gradient all-reduce", LOST, store=store)
    assert isinstance(error, RuntimeError) and not isinstance(error, stalls.StallError)
    assert str(error).startswith(
        "rank 0 could not finish pack 1/1 of the gradient all-reduce at step 3: rank 1 stopped answering, on node7 "
        "(pid 4242), last seen at step 3, backward: it was killed, froze or became unreachable. "), str(error)
    assert time.monotonic() - start < 8 * 0.05 + 0.5


class LateStallStore(Store):
    """The peer's gloo closed the link when its wait timed out, and its stall text lands just after."""

    def __init__(self, positions, text):
        super().__init__(positions)
        self.text, self.stall_checks = text, 0

    def check(self, keys):
        if any(k.rsplit("/", 2)[-2] == "stall" for k in keys):
            self.stall_checks += 1
            return self.stall_checks > 1
        return super().check(keys)

    def get(self, key):
        return self.text if key.rsplit("/", 2)[-2] == "stall" else super().get(key)


def test_a_link_closed_by_a_peer_whose_wait_timed_out_raises_that_peers_stall_error_written_just_after():
    text = b"ranks 0, 1 waited more than 3 s at step 3 for pack 1/1 (the same text on every rank)"
    position = json.loads(_position(1, 3, "before backward", pid=None))
    store = LateStallStore({1: json.dumps(dict(position, state="crashed (StallError)")).encode()}, text)
    error = stalls.translate(_survivor(), 5, "pack 1/1 of the gradient all-reduce", LOST, store=store)
    assert isinstance(error, stalls.StallError), error
    assert str(error) == text.decode()


def test_a_failure_that_is_not_a_lost_link_is_kept_after_a_short_wait_for_parting_words(monkeypatch):
    monkeypatch.setattr(stalls, "TICK", 0.05)
    store = Store({1: _position(1, 3, "backward", host="node7", pid=4242, space="node7/other")})
    assert stalls.translate(_survivor(), 5, "pack 1/1", RuntimeError("Gloo: invalid argument"), store=store) is None


def test_a_peer_killed_on_this_host_is_named_at_once_from_its_pid():
    store = Store({1: _position(1, 3, "before backward", pid=_ended_pid())})
    start = time.monotonic()
    error = stalls.translate(_survivor(), 5, "pack 1/1 of the gradient all-reduce", LOST, store=store)
    assert time.monotonic() - start < 1.0  # not the silence threshold: the pid says it
    assert "rank 1 was killed, on " in str(error) and ", last seen at step 3, before backward: its process ended " \
           "without saying how (SIGKILL, the out-of-memory killer, os._exit). The other ranks cannot go on " \
           "without it: look in the kernel's log (dmesg)" in str(error), str(error)


def test_a_process_that_is_exiting_but_not_yet_a_zombie_has_ended():
    # A killed process closes its links while it exits, before it turns zombie: a survivor that reads
    # the broken link at once sees it running ("R"), with the kernel's exiting flag (0x4) in field 9.
    running = "4242 (python3 -m x) R 1 4242 4242 0 -1 4194560 9 0 0 0"
    exiting = "4242 (python3 -m x) R 1 4242 4242 0 -1 4194564 9 0 0 0"
    zombie = "4242 (python3 -m x) Z 1 4242 4242 0 -1 4227332 9 0 0 0"
    assert [stalls._stat_says_ended(s) for s in (running, exiting, zombie)] == [False, True, True]


def test_a_peer_killed_on_this_host_with_the_store_is_named_from_the_identity_learned_before():
    pid = _ended_pid()
    survivor = _survivor()
    survivor.peers[1] = {k: v for k, v in json.loads(_position(1, 2, "backward", pid=pid)).items()
                         if k in ("host", "pid", "space")}
    error = stalls.translate(survivor, 5, "pack 1/1 of the gradient all-reduce", LOST, store=Store({}, gone=True))
    assert f"(pid {pid}): its process ended without saying how (SIGKILL" in str(error), str(error)
    assert "what it was doing is unknown, since the rendezvous store does not answer either" in str(error)


def test_with_the_store_gone_and_peers_elsewhere_the_error_says_so_rather_than_gloos_words():
    survivor = _survivor()
    survivor.peers[1] = {"host": "node7", "pid": 4242, "space": "node7/other"}
    error = stalls.translate(survivor, 5, "pack 1/1", LOST, store=Store({}, gone=True))
    assert "the rendezvous store does not answer either" in str(error), str(error)
    assert "Rank 1 (on node7) could not be checked from here: see its log" in str(error), str(error)


# ---------------------------------------------------------------------- hints inside a join block

def _waiting_for_rank_1(in_join, rank_1_in_join):
    """Rank 0 waits for pack 1 of step 3; rank 1 is between steps, in none of this optimizer's collectives."""
    waiting = _survivor(in_join)
    waiting.issued = 5
    waiting.begin(5, "pack 1/1 of the gradient all-reduce")
    store = Store({1: _position(1, 3, "before backward", in_join=rank_1_in_join)})
    return stalls.stall_error(waiting, 5, "pack 1/1 of the gradient all-reduce", store=store)


def test_outside_a_join_block_a_rank_busy_elsewhere_is_told_to_wrap_the_loop_in_one():
    assert "a metric's all-reduce after its data ran out: wrap the training loop in `with opt.join():`" in str(
        _waiting_for_rank_1(False, False))


def test_inside_a_join_block_a_rank_busy_elsewhere_is_told_to_move_its_collectives_after_the_block():
    text = str(_waiting_for_rank_1(True, True))
    assert "rank 1 has not arrived: last seen at step 3, before backward. A rank between steps and not in a " \
           "collective of this optimizer is busy elsewhere: evaluating, saving a checkpoint, or in a collective of " \
           "your own. Every rank is inside `with opt.join():`, where a collective of your own (a metric's " \
           "all-reduce, a barrier) cannot run once a rank has run out of data: that rank waits in the join and " \
           "cannot take part. Move it after the block" in text, text
    assert "wrap" not in text


def test_when_only_some_ranks_are_inside_a_join_block_the_stall_names_them():
    text = str(_waiting_for_rank_1(True, False))
    assert "Rank 0 is inside a join block of this optimizer and rank 1 is not: every rank must enter the same join " \
           "block, with the same optimizers (`with opt.join():`, or `with distopt.join(opt1, opt2):` for " \
           "several), around the same training loop, a rank without data too" in text, text
    assert "wrap" not in text


def test_inside_a_join_block_a_peer_that_finished_outside_one_is_named_as_not_in_the_block():
    store = Store({1: json.dumps(dict(json.loads(_position(1, 0, "construction")), state="finished")).encode()})
    text = str(stalls.translate(_survivor(in_join=True), 5, "pack 1/1", LOST, store=store))
    assert "rank 1 is gone: it finished after step 0 (construction)" in text, text
    assert text.endswith(". This rank is inside a join block of this optimizer and rank 1 was not when it left: "
                         "every rank must enter the same join block, with the same optimizers (`with opt.join():`, "
                         "or `with distopt.join(opt1, opt2):` for several), around the same training loop, a rank "
                         "without data too"), text


def test_ranks_whose_join_blocks_differ_are_told_what_differs_not_to_enter_a_block():
    totals = Totals(during_backward=2, inside_step=0, unfrozen=0, contributing=2, in_join=1, divide_by_world=0,
                    counts_steps=0, odd_steps=0, closure=0)
    with pytest.raises(RuntimeError, match=re.escape(
            "1 of 2 ranks are inside a join block of this optimizer and the others are not (they are outside any "
            "block, or in a block over other optimizers): every rank must enter the same join block, with the same "
            "optimizers")):
        totals.check(2)


# ---------------------------------------------------------------------- which rank is the cause, and where it was

def _published(rank, step, phase, **fields):
    """Rank ``rank``'s position as the store holds it, with ``fields`` (state, failed, ...) over the defaults."""
    return json.dumps(dict(json.loads(_position(rank, step, phase)), **fields)).encode()


def _survivor_of_three(step=4):
    return Progress(group="g", ranks=[0, 1, 2], rank=0, warn_after=None, raise_after=None, step=step)


def test_a_survivor_that_failed_because_of_the_killed_rank_is_named_after_it_and_not_as_killed():
    # Rank 2 was killed; rank 1 failed in the same all-reduce, said so, and exited before it published
    # how: its pid is gone too, but it is not a cause.
    store = Store({1: _published(1, 4, "in backward", pid=_ended_pid(), failed="pack 1/1 of the gradient all-reduce",
                                 failed_step=4, lost=True, error="RuntimeError: rank 1 could not finish ..."),
                   2: _published(2, 3, "before backward", pid=_ended_pid(), issued=9)})
    survivor = _survivor_of_three()
    survivor.issued = 10
    text = str(stalls.translate(survivor, 10, "pack 1/1 of the gradient all-reduce", LOST, store=store))
    assert re.search(r"^rank 0 could not finish pack 1/1 of the gradient all-reduce at step 4: rank 2 was killed, "
                     r"on \S+ \(pid \d+\), last seen at step 3, before backward: its process ended without saying how "
                     r"\(SIGKILL, the out-of-memory killer, os._exit\); rank 1 failed too, in pack 1/1 of the gradient "
                     r"all-reduce at step 4, where a peer was gone as well, on \S+ \(pid \d+\)\. The other ranks "
                     r"cannot go on without it", text), text
    assert "rank 1 was killed" not in text, text


def test_a_killed_peer_whose_last_report_is_older_than_a_collective_it_took_part_in_is_last_seen_there():
    # Killed right after it took part in step 3's all-reduce, within a tick of its construction.
    store = Store({1: _published(1, 0, "construction", pid=_ended_pid(), issued=2)})
    survivor = _survivor()
    survivor.step, survivor.issued = 4, 10
    survivor.met, survivor.met_step, survivor.met_what = 9, 3, "pack 1/1 of the gradient all-reduce"
    text = str(stalls.translate(survivor, 10, "pack 1/1 of the gradient all-reduce", LOST, store=store))
    assert ", last seen at step 3, in pack 1/1 of the gradient all-reduce, which it took part in (its own last " \
           "report, older, said step 0, construction): its process ended without saying how" in text, text


SHARDED_STATE_DICT = ("RuntimeError: state_dict() with shard_state=True gathers every rank's shard of the optimizer "
                      "state, but ranks [0] did not call it within 60 s: call opt.state_dict() on every rank at the "
                      "same point (then save it on one rank only)")


def test_a_peer_that_exited_after_one_of_the_wrappers_calls_failed_is_said_to_have_exited_there_not_finished():
    # The minGPT snapshot: state_dict() on rank 1 only; its error was caught and turned into sys.exit(1).
    store = Store({1: _published(1, 94, "before backward", state="exited", failed_step=94, error=SHARDED_STATE_DICT,
                                 failed="the gathering of the sharded state dict (state_dict())")})
    text = str(stalls.translate(_survivor(), 5, "pack 1/1 of the gradient all-reduce", LOST, store=store))
    assert "rank 1 is gone: it exited while it waited for the other ranks in the gathering of the sharded state " \
           f"dict (state_dict()) at step 94, on " in text, text
    assert text.endswith(f": {SHARDED_STATE_DICT}. See that rank's output for the cause"), text
    assert "finished" not in text and "join" not in text, text


def test_a_peer_that_exited_with_a_nonzero_status_is_not_said_to_have_finished():
    store = Store({1: _published(1, 3, "before backward", state="exited with status 1")})
    text = str(stalls.translate(_survivor(), 5, "pack 1/1 of the gradient all-reduce", LOST, store=store))
    assert "rank 1 is gone: it exited with status 1 after step 3 (before backward)" in text, text
    assert text.endswith(". See that rank's output for the cause"), text


def test_how_a_process_ends_is_finished_only_for_a_clean_exit():
    assert [stalls.ending(e) for e in (SystemExit(0), SystemExit(None), SystemExit(1), SystemExit("bad batch"),
                                       ZeroDivisionError("a bad batch"))] == [
        "finished", "finished", "exited with status 1", "exited with status 1",
        "crashed (ZeroDivisionError: a bad batch)"]
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert stalls.ending() == "crashed (KeyboardInterrupt)"
    assert stalls.ending() == "finished"


class _Inspector:
    """The process's inspector, as far as mark_exit and a failure's publication need it."""

    def __init__(self, progress):
        self.progress, self.store, self.retired = progress, RecordingStore(), []
        self.stopping = threading.Event()

    def live(self):
        return [self.progress]


class RecordingStore:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


def test_a_rank_whose_call_of_the_wrapper_failed_publishes_it_at_once_and_its_exit_as_exited_not_finished(monkeypatch):
    progress = _survivor()
    inspector = _Inspector(progress)
    monkeypatch.setattr(stalls, "_inspector", inspector)
    progress.fail("the gathering of the sharded state dict (state_dict())",
                  RuntimeError(SHARDED_STATE_DICT[len("RuntimeError: "):]))
    published = json.loads(inspector.store.values["distopt/progress/g/0"])
    assert (published["state"], published["failed"], published["error"]) == (
        "running", "the gathering of the sharded state dict (state_dict())", SHARDED_STATE_DICT)
    stalls.mark_exit("finished")  # the interpreter's exit after sys.exit(1): its status is not known
    assert json.loads(inspector.store.values["distopt/progress/g/0"])["state"] == "exited"


def test_a_rank_that_went_on_after_a_failed_call_finishes_as_finished(monkeypatch):
    progress = _survivor()
    inspector = _Inspector(progress)
    monkeypatch.setattr(stalls, "_inspector", inspector)
    progress.fail("the gathering of the sharded state dict (state_dict())", RuntimeError("not every rank called it"))
    progress.issue()  # the next collective: it caught the error and trained on
    stalls.mark_exit("finished")
    assert json.loads(inspector.store.values["distopt/progress/g/0"])["state"] == "finished"

