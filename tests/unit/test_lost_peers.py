"""How a rank that lost a peer explains it, from the positions in the store alone (no processes).

A peer killed on another host shows only as a position that stops changing: the
survivor must wait past the silence threshold before it gives up on naming it. A peer
killed on this host is named at once, from its pid, even when the store went with it.
"""
import json
import subprocess
import sys
import time

import pytest

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


def _position(rank, step, phase, **identity):
    progress = Progress(group="g", ranks=[0, 1], rank=rank, warn_after=None, raise_after=None, step=step, phase=phase)
    return json.dumps(dict(json.loads(progress.payload()), **identity)).encode()


def _survivor():
    return Progress(group="g", ranks=[0, 1], rank=0, warn_after=None, raise_after=None, step=3)


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
