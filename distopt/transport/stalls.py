"""The stall inspector: who is missing when a rank waits, and who is gone when a link breaks.

Every wrapper keeps a :class:`Progress`: its step, its phase and how many of its
collectives it has issued. The hot path only writes these attributes. One
background thread per process publishes them to the process group's own store
about once a second (a store ``set`` is a single message, with no reply to
wait for), and watches the waits: once a rank has waited ``warn_after`` seconds
for one of the wrapper's collectives, it reads every member's position from the
store and logs who has not arrived and where each was last seen.

The waits themselves raise :class:`StallError` after ``raise_after`` seconds,
with a text built from the store alone, so every waiting rank tells the same
story. When a collective fails because a peer went away, :func:`translate`
names the rank and says whether it finished, crashed or fell silent.

Nothing here opens a listener: the store is torch's, reached through a clone of
the default store's client (one connection per thread, as torch requires).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist

__all__ = ["StallError", "Progress", "watch", "retire", "inspected", "translate", "stall_error", "mark_exit", "stop",
           "main_store"]

logger = logging.getLogger("distopt")

#: Seconds between two publications of a rank's position (and checks for stalls).
TICK = 1.0
# A rank whose position is older than this many ticks shows no sign of life.
_SILENT_TICKS = 5
_PREFIX = "distopt/progress"
# gloo's and torch's wordings of a collective that ran out of time.
_TIMEOUT_WORDS = ("timed out", "timeout")


class StallError(RuntimeError):
    """A rank waited longer than ``stall_timeout`` for the other ranks in one of distopt's collectives.

    Every waiting rank raises it with the same text: the collective, the ranks that
    waited, and for each missing rank where it was last seen.
    """


@dataclass(eq=False)
class Progress:
    """Where one wrapper's rank is; written by the hot path, published by the inspector thread.

    Attributes:
        group: name of the wrapper's private process group (the same on every rank).
        ranks: the group's members, as global ranks.
        rank: this process's global rank.
        warn_after: seconds of waiting before a warning, or None for none.
        raise_after: seconds of waiting before :class:`StallError`, or None.
        timeout: the group's collective timeout in seconds, if known: a collective that
            fails with it is reported as a stall of that length.
        step: steps taken by the wrapper.
        phase: what the rank is doing, in words ("backward", "inside step()", ...).
        issued: collectives issued on the group so far; collective ``k`` is the k-th.
        waiting: the collective being waited for, or 0.
        what: that collective, in words.
        since: when the wait for it started (``time.monotonic``).
        state: "running", or how the process ended ("finished", "crashed (...)").
    """

    group: str
    ranks: List[int]
    rank: int
    warn_after: Optional[float]
    raise_after: Optional[float]
    timeout: Optional[float] = None
    step: int = 0
    phase: str = "construction"
    issued: int = 0
    waiting: int = 0
    what: str = ""
    since: float = 0.0
    state: str = "running"
    warned: int = 0
    last_wait: int = 0
    cuda_works: Deque[Tuple[int, str, float, Any]] = field(default_factory=lambda: deque(maxlen=64))

    def issue(self) -> int:
        """Count one more collective; return its number."""
        self.issued += 1
        return self.issued

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Transfers between some members only (point-to-point), which the others do not count.

        Inside, they are numbered on from the collectives issued so far, and watched like
        them; afterwards the count is what it was, so that every member's count of the
        group's collectives stays comparable with the others'.
        """
        issued = self.issued
        try:
            yield
        finally:
            self.issued = issued
            self.last_wait = 0  # the numbers used inside come again: a wait for one starts afresh

    def begin(self, seq: int, what: str) -> None:
        """Start (or resume) waiting for collective ``seq``."""
        if seq != self.waiting:
            if seq != self.last_wait:  # a resumed wait (a round left pending) keeps its start
                self.since = time.monotonic()
            self.last_wait = seq
            self.what = what
            self.waiting = seq

    def end(self) -> None:
        self.waiting = 0

    def waited(self) -> float:
        return time.monotonic() - self.since

    def payload(self) -> str:
        return json.dumps({"step": self.step, "phase": self.phase, "issued": self.issued, "waiting": self.waiting,
                           "what": self.what, "state": self.state, "t": time.time()})


# ---------------------------------------------------------------------- the inspector thread

class _Inspector:
    """One per process: publishes every registered :class:`Progress` and warns about long waits."""

    def __init__(self, store: Any) -> None:
        self.store = store.clone()  # for the main thread
        # Live wrappers' positions, published every tick; those of closed wrappers are published
        # once more when the process ends, so that peers read how it ended.
        self.progresses: "weakref.WeakSet[Progress]" = weakref.WeakSet()
        self.retired: Deque[Progress] = deque(maxlen=16)
        self.lock = threading.Lock()  # the main thread adds and retires while the thread iterates
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(store.clone(),), name="distopt-stall-inspector",
                                       daemon=True)
        self.thread.start()

    def live(self) -> List[Progress]:
        with self.lock:
            return list(self.progresses)

    def _run(self, store: Any) -> None:
        while not self.stopping.wait(TICK):
            for progress in self.live():
                try:
                    store.set(_key(progress.group, progress.rank), progress.payload())
                except Exception:  # the store is gone (shutdown, the host died): nothing left to report to
                    self.stopping.set()
                    return
                try:
                    self._check(progress, store)
                except Exception as exc:  # a report that failed must not end the watch
                    logger.debug("distopt: stall check failed: %r", exc)

    def _check(self, progress: Progress, store: Any) -> None:
        now = time.monotonic()
        while progress.cuda_works and progress.cuda_works[0][3].is_completed():
            progress.cuda_works.popleft()
        seq, what, since = progress.waiting, progress.what, progress.since
        if progress.cuda_works:  # NCCL: the host does not wait, the stream does
            seq, what, since, _ = progress.cuda_works[0]
        if not seq or progress.warn_after is None or progress.warned == seq or now - since < progress.warn_after:
            return
        progress.warned = seq
        logger.warning("distopt: %s", _report(progress, seq, what, store, waited=now - since))


_inspector: Optional[_Inspector] = None
_registered_exit = False


def watch(progress: Progress) -> None:
    """Start publishing ``progress`` (and start the process's inspector thread if needed)."""
    global _inspector, _registered_exit
    if _inspector is None or _inspector.stopping.is_set():
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store to publish to: waits still time out, without the peers' positions
            return
        _inspector = _Inspector(store)
        if not _registered_exit:
            atexit.register(_at_exit)
            _registered_exit = True
    with _inspector.lock:
        _inspector.progresses.add(progress)
    with contextlib.suppress(Exception):
        _inspector.store.set(_key(progress.group, progress.rank), progress.payload())


def retire(progress: Progress) -> None:
    """Stop publishing ``progress`` (its wrapper is closed) until the process ends."""
    if _inspector is None:
        return
    with _inspector.lock:
        if progress not in _inspector.progresses:
            return
        _inspector.progresses.discard(progress)
    progress.phase = f"{progress.phase}; its DistributedOptimizer was closed"
    progress.cuda_works.clear()
    _inspector.retired.append(progress)
    with contextlib.suppress(Exception):
        _inspector.store.set(_key(progress.group, progress.rank), progress.payload())


def mark_exit(state: str) -> None:
    """Publish how this process ends ("finished", "crashed (...)"), at once, for the peers' errors."""
    if _inspector is None:
        return
    for progress in _inspector.live() + list(_inspector.retired):
        if progress.state == "running":
            progress.state = state
        with contextlib.suppress(Exception):
            _inspector.store.set(_key(progress.group, progress.rank), progress.payload())


def stop() -> None:
    """Stop the inspector thread (before the process group and the interpreter go away)."""
    global _inspector
    inspector, _inspector = _inspector, None
    if inspector is not None:
        inspector.stopping.set()
        inspector.thread.join(timeout=2 * TICK)


def _at_exit() -> None:
    error = getattr(sys, "last_value", None)
    mark_exit("finished" if error is None else f"crashed ({type(error).__name__}: {error})")
    stop()


# ---------------------------------------------------------------------- reading the others' positions

def _key(group: str, rank: int) -> str:
    return f"{_PREFIX}/{group}/{rank}"


def _positions(progress: Progress, store: Any) -> Dict[int, Optional[Dict[str, Any]]]:
    positions: Dict[int, Optional[Dict[str, Any]]] = {}
    for rank in progress.ranks:
        key = _key(progress.group, rank)
        try:
            positions[rank] = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:
            positions[rank] = None
    return positions


def _seen(position: Optional[Dict[str, Any]], ages: bool) -> str:
    if position is None:
        return "never seen (it has not built this optimizer)"
    where = f"last seen at step {position['step']}, {position['phase']}"
    if position["state"] != "running":
        return f"{where}; it {position['state']}"
    age = time.time() - position["t"]
    if age > _SILENT_TICKS * TICK:
        return f"{where}; no sign of life for {age:.0f} s (killed, frozen or unreachable)"
    return f"{where} ({age:.0f} s ago)" if ages else where


def _report(progress: Progress, seq: int, what: str, store: Any, waited: Optional[float] = None) -> str:
    """Who waits for collective ``seq``, and where each rank that has not issued it was last seen.

    With ``waited`` (a warning) the text is this rank's view; without (an error) it
    is built from the store alone, so every waiting rank writes the same.
    """
    positions = _positions(progress, store)
    positions[progress.rank] = json.loads(progress.payload())
    missing = [r for r, p in positions.items() if p is None or p["issued"] < seq]
    waiting = [r for r, p in positions.items() if p is not None and p["waiting"] == seq]
    if waited is not None:
        head = f"rank {progress.rank} has waited {waited:.0f} s at step {progress.step} for {what}"
    else:
        head = f"{_ranks(waiting)} waited {_limit(progress)} at step {progress.step} for {what}"
    if not missing:
        # Collectives pair by number: the same number on different calls means one rank made a call
        # with a collective of its own (add_param_group(), broadcast_parameters()) that the others did not.
        doing = {r: p["what"] for r, p in sorted(positions.items()) if p is not None and p["waiting"] == seq}
        if len(set(doing.values())) > 1:
            detail = "; ".join(f"rank {r} in {w}" for r, w in doing.items())
            return (f"{head}; the ranks are in different collectives of this optimizer, paired with each other "
                    f"({detail}): a call that communicates (add_param_group(), broadcast_parameters(), "
                    "broadcast_optimizer_state(), synchronize() before backward) was made on some ranks only; "
                    "make it on every rank, at the same point")
        return (f"{head}; every rank has issued it, so the data is slow to arrive (a slow or broken link, "
                "or a rank stuck inside the transport)")
    lines = [f"rank {r} has not arrived: {_seen(positions[r], waited is not None)}" for r in missing]
    elsewhere = [r for r in missing if positions[r] is not None and not positions[r]["waiting"]
                 and positions[r]["state"] == "running" and time.time() - positions[r]["t"] <= _SILENT_TICKS * TICK
                 and positions[r]["phase"].startswith(("before backward", "after backward"))]
    hint = ""
    if elsewhere:
        hint = (". A rank between steps and not in a collective of this optimizer is busy elsewhere: "
                "in a collective of your own (a metric's all-reduce after its data ran out: wrap the training "
                "loop in `with opt.join():`), evaluating, or saving a checkpoint")
    return f"{head}; " + "; ".join(lines) + hint


def _limit(progress: Progress) -> str:
    limit = progress.raise_after if progress.raise_after is not None else progress.timeout
    return "past the collective timeout" if limit is None else f"more than {limit:g} s"


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def main_store() -> Any:
    """The main thread's connection to the store, or None without an inspector."""
    return None if _inspector is None else _inspector.store


_store = main_store


def stall_error(progress: Progress, seq: int, what: str) -> StallError:
    """The :class:`StallError` for collective ``seq``, with the same text on every waiting rank."""
    store = _store()
    if store is None:
        return StallError(f"rank {progress.rank} waited {_limit(progress)} at step {progress.step} for {what}; "
                          "the other ranks' positions are unknown (no store)")
    key = f"{_PREFIX}/{progress.group}/stall/{seq}"
    text = _report(progress, seq, what, store)
    try:
        # The first rank to give up writes the text; the others repeat it.
        text = store.compare_set(key, "", text).decode()
    except Exception:
        pass
    progress.state = "crashed (StallError)"
    mark_exit(progress.state)
    return StallError(text)


def _gone(progress: Progress, store: Any) -> List[Tuple[int, Dict[str, Any]]]:
    """The members that finished, crashed or fell silent, retried briefly: a peer publishes as it leaves."""
    deadline = time.monotonic() + 2 * TICK
    while True:
        positions = _positions(progress, store)
        gone = [(r, p) for r, p in positions.items() if r != progress.rank and p is not None
                and (p["state"] != "running" or time.time() - p["t"] > _SILENT_TICKS * TICK)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def translate(progress: Progress, seq: int, what: str, exc: BaseException) -> Optional[BaseException]:
    """The error to raise instead of the transport's ``exc`` in collective ``seq``, or None to keep it.

    A timeout becomes :class:`StallError`. A failure caused by a peer that went away
    names that peer and how it ended; if the peer gave up with :class:`StallError`,
    this rank raises the same.
    """
    message = str(exc).lower()
    if isinstance(exc, StallError):
        return None
    if any(word in message for word in _TIMEOUT_WORDS):
        return stall_error(progress, seq, what)
    store = _store()
    if store is None:
        return None
    stalled = f"{_PREFIX}/{progress.group}/stall/{seq}"
    with contextlib.suppress(Exception):
        if store.check([stalled]):
            return StallError(store.get(stalled).decode())
    gone = _gone(progress, store)
    if not gone:
        return None
    parts = []
    for rank, position in gone:
        where = f"after step {position['step']} ({position['phase']})"
        if position["state"] == "running":
            parts.append(f"rank {rank} stopped answering {where}: it was killed, froze or became unreachable")
        else:
            parts.append(f"rank {rank} is gone: it {position['state']} {where}")
    hint = ""
    if any(p["state"] == "finished" for _, p in gone):
        hint = (". A rank that finishes while others still train leaves them waiting: give every rank the same "
                "number of batches (e.g. DistributedSampler(drop_last=True)), or wrap the loop in "
                "`with opt.join():`")
    elif any(p["state"].startswith("crashed") for _, p in gone):
        hint = ". See that rank's traceback for the cause"
    text = (f"rank {progress.rank} could not finish {what} at step {progress.step}: " + "; ".join(parts) + hint)
    return RuntimeError(text)


@contextlib.contextmanager
def inspected(progress: Optional[Progress], what: str) -> Iterator[None]:
    """Run a blocking collective of the wrapper's: watched for stalls, with its errors explained."""
    if progress is None:
        yield
        return
    seq = progress.issue()
    progress.begin(seq, what)
    try:
        yield
    except RuntimeError as exc:
        better = translate(progress, seq, what, exc)
        if better is None:
            raise
        raise better from exc
    finally:
        progress.end()
