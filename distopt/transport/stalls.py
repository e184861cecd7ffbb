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
names the rank and says whether it finished, crashed, was killed or fell silent.
A rank that one of the wrapper's calls failed on publishes that at once
(:meth:`Progress.fail`): however it then exits, the others say where it waited and
why, not that it finished, and a rank whose own collective lost the same peer is
named after the cause, not as one.
Each position also says which process published it (host and pid), and the
inspector keeps the peers' identities once it has read them, so that a peer
killed on this host is named even when the store went with it (a rank started
by hand with env:// hosts the store on rank 0; torchrun's agent hosts it).

Nothing here opens a listener: the store is torch's, reached through a clone of
the default store's client (one connection per thread, as torch requires).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist

from ..planning.control import SAME_JOIN_BLOCK

__all__ = ["StallError", "Progress", "watch", "retire", "inspected", "explain", "translate", "stall_error",
           "mark_exit", "ending", "stop", "main_store", "closed_members"]

logger = logging.getLogger("distopt")

#: Seconds between two publications of a rank's position (and checks for stalls).
TICK = 1.0
# A rank whose position is older than this many ticks shows no sign of life.
_SILENT_TICKS = 5
# A peer's closed wrapper is reported once it has stayed closed this many ticks without the process ending.
_CLOSED_GRACE_TICKS = 2
_PREFIX = "distopt/progress"
# The state a rank publishes once it has written the stall text that every waiting rank raises.
_STALLED = "crashed (StallError)"
# gloo's and torch's wordings of a collective that ran out of time.
_TIMEOUT_WORDS = ("timed out", "timeout")
# gloo's wordings of a link a peer closed ("Connection closed by peer", "Connection reset by peer").
_LOST_WORDS = ("connection", "peer", "broken pipe", "socket")
# The longest error of a rank's failure that its position carries to the peers' errors.
_ERROR_CHARS = 600
# The kernel's flag of a process that is exiting (field 9 of /proc/PID/stat).
_PF_EXITING = 0x4


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
        closed: the wrapper was closed (``close()``, or garbage-collected); its position is no
            longer published, so its age says nothing.
        in_join: the wrapper is inside a join block (``with opt.join():``) on this rank.
        joined: inside that block, this rank ran out of data: it waits in its last round and the shadow
            rounds, which a call that communicates made by the others inside the block meets instead of its own.
        failed: the call of the wrapper that an error left last (a collective, ``state_dict()``'s
            meeting), in words, or "" (cleared by the next collective issued); published at once.
        failed_step: the step it failed at.
        error: that error, as ``"Type: message"``.
        lost: that error was a peer gone away: this rank failed because of another's end.
        met: the last collective every member is known to have issued: it completed here, and
            each member's contribution was in it.
        met_step: the step it completed at.
        met_what: it, in words.
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
    closed: bool = False
    in_join: bool = False
    joined: bool = False
    failed: str = ""
    failed_step: int = 0
    error: str = ""
    lost: bool = False
    met: int = 0
    met_step: int = 0
    met_what: str = ""
    warned: int = 0
    last_wait: int = 0
    cuda_works: Deque[Tuple[int, str, float, Any]] = field(default_factory=lambda: deque(maxlen=64))
    #: The other members' identities (host, pid), by rank, read from the store while it answers.
    peers: Dict[int, Dict[str, Any]] = field(default_factory=dict)

    def issue(self) -> int:
        """Count one more collective; return its number."""
        self.issued += 1
        self.failed = ""  # it went on after the error: what ends it later is something else
        return self.issued

    def meet(self, seq: int, what: str) -> None:
        """Collective ``seq``, to which every member contributed, completed here."""
        if seq > self.met:
            self.met, self.met_step, self.met_what = seq, self.step, what

    def fail(self, what: str, error: BaseException, lost: bool = False) -> None:
        """``error`` leaves ``what``, one of the wrapper's calls: publish it at once, for the peers.

        A rank that exits now did not finish: the peers' errors say where it was and why
        (:func:`mark_exit` publishes it as "exited", whatever its exit status).

        Args:
            what: the call, in words.
            error: the error raised to the caller.
            lost: ``error`` says that a peer went away.
        """
        self.failed, self.failed_step, self.lost = what, self.step, lost
        text = f"{type(error).__name__}: {error}"
        self.error = text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "..."
        _publish(self)

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
                           "what": self.what, "state": self.state, "closed": self.closed, "in_join": self.in_join,
                           "joined": self.joined,
                           "failed": self.failed, "failed_step": self.failed_step, "error": self.error,
                           "lost": self.lost,
                           "t": time.time(), **_identity()})


@lru_cache(maxsize=None)
def _pid_space() -> str:
    """Which pids this process can see: a peer's pid means something here only if its space is the same.

    The host name alone is not enough: containers on one machine may share it but not their pids.
    """
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return "/".join(parts)


def _identity() -> Dict[str, Any]:
    # The pid is read each time: a forked child publishes its own.
    return {"host": socket.gethostname(), "pid": os.getpid(), "space": _pid_space()}


def _process_ended(identity: Optional[Dict[str, Any]]) -> bool:
    """Whether the process ``identity`` names is known to have ended: it ran where this one can see its pid."""
    if not identity or identity.get("space") != _pid_space() or not identity.get("pid"):
        return False
    try:
        os.kill(identity["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    with contextlib.suppress(OSError):
        with open(f"/proc/{identity['pid']}/stat") as f:
            return _stat_says_ended(f.read())
    return False


def _stat_says_ended(stat: str) -> bool:
    """Whether a process's ``/proc/PID/stat`` says that it has ended, or is ending.

    A zombie still has its pid until its parent reaps it, but it has ended. A killed process
    closes its connections while it exits, before it turns zombie: a peer that reads the broken
    link at once finds it still running (once in 20 kills of an idle process, more under load),
    but already marked as exiting, from the first instant of its exit.
    """
    with contextlib.suppress(IndexError, ValueError):
        fields = stat.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    return False


# ---------------------------------------------------------------------- the inspector thread

class _Inspector:
    """One per process: publishes every registered :class:`Progress` and warns about long waits."""

    def __init__(self, store: Any) -> None:
        self.store = store.clone()  # for the main thread
        # Live wrappers' positions, published every tick; those of closed wrappers are published
        # once more when the process ends, so that peers read how it ended.
        self.progresses: "weakref.WeakSet[Progress]" = weakref.WeakSet()
        self.retired: Deque[Progress] = deque(maxlen=16)
        self.lock = threading.Lock()  # the main thread adds while the thread iterates
        # Closed wrappers' positions, taken out of ``progresses`` under the lock by the next live(). A wrapper
        # that the garbage collector frees retires from its finalizer, which runs on whichever thread allocated:
        # inside live() too, with the lock held by that very thread. So retire() never waits for the lock.
        self.leaving: Deque[Progress] = deque()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(store.clone(),), name="distopt-stall-inspector",
                                       daemon=True)
        self.thread.start()

    def live(self) -> List[Progress]:
        with self.lock:
            while self.leaving:
                self.progresses.discard(self.leaving.popleft())
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
                    _learn_peers(progress, store)
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
    """Stop publishing ``progress`` (its wrapper is closed) until the process ends.

    May be called from a finalizer (a wrapper freed by the garbage collector), on any thread and
    while this module's own code holds its lock: it takes no lock.
    """
    if _inspector is None or progress.closed or progress not in _inspector.progresses:
        return
    _inspector.leaving.append(progress)
    progress.phase = f"{progress.phase}; its DistributedOptimizer was closed"
    progress.closed = True
    progress.cuda_works.clear()
    _inspector.retired.append(progress)
    with contextlib.suppress(Exception):
        _inspector.store.set(_key(progress.group, progress.rank), progress.payload())


def mark_exit(state: str) -> None:
    """Publish how this process ends (see :func:`ending`), at once, for the peers' errors.

    A wrapper whose last call failed (:meth:`Progress.fail`) did not finish, whatever the
    process says: it is published as "exited", and its failure tells the peers where it was.
    """
    if _inspector is None or _inspector.stopping.is_set():  # stopped: the store is gone
        return
    for progress in _inspector.live() + list(_inspector.retired):
        if progress.state == "running":
            progress.state = "exited" if state == "finished" and progress.failed else state
        with contextlib.suppress(Exception):
            _inspector.store.set(_key(progress.group, progress.rank), progress.payload())


def ending(error: Optional[BaseException] = None) -> str:
    """How a process that ends now ends, in the words the peers' errors use.

    Args:
        error: the exception it ends with; by default the one this thread is handling, or that
            is passing through the ``finally`` block this is called from, if any.

    Returns:
        "finished", "exited with status N" (``sys.exit(N)``, N not 0) or "crashed (Type: message)".
    """
    if error is None:
        error = sys.exc_info()[1]
    if error is None:
        return "finished"
    if isinstance(error, SystemExit):
        if error.code in (None, 0):
            return "finished"
        # sys.exit("text") prints the text and exits with status 1.
        return f"exited with status {error.code if isinstance(error.code, int) else 1}"
    return f"crashed ({type(error).__name__}{f': {error}' if str(error) else ''})"


def _publish(progress: Progress) -> None:
    """Publish ``progress`` now, from the calling thread (a failure the peers must read before this rank ends)."""
    if _inspector is None or _inspector.stopping.is_set():
        return
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
    # An uncaught exception is in sys.last_value; the status of sys.exit() at the top is not known here
    # (the interpreter keeps it to itself), but a failed call of the wrapper is (see mark_exit).
    error = getattr(sys, "last_value", None)
    mark_exit("finished" if error is None else ending(error))
    stop()


# ---------------------------------------------------------------------- reading the others' positions

def _key(group: str, rank: int) -> str:
    return f"{_PREFIX}/{group}/{rank}"


def _positions(progress: Progress, store: Any, strict: bool = False) -> Dict[int, Optional[Dict[str, Any]]]:
    """Every member's last published position (None: never published).

    Args:
        strict: raise if the store does not answer, instead of reading that rank as never seen.
    """
    positions: Dict[int, Optional[Dict[str, Any]]] = {}
    for rank in progress.ranks:
        key = _key(progress.group, rank)
        try:
            positions[rank] = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:
            if strict:
                raise
            positions[rank] = None
    return positions


def _learn_peers(progress: Progress, store: Any) -> None:
    """Keep the identities of the peers that have published, for when the store is gone."""
    for rank in progress.ranks:
        if rank == progress.rank or rank in progress.peers:
            continue
        key = _key(progress.group, rank)
        if store.check([key]):
            position = json.loads(store.get(key))
            progress.peers[rank] = {k: position.get(k) for k in ("host", "pid", "space")}


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
            joined = [r for r in doing if positions[r].get("joined")]
            if joined:
                # Every rank still training made the call: "on some ranks only" would send the user looking
                # for a rank that skipped it, while the one pairing it with a round is the rank that has joined.
                return (f"{head}; the ranks are in different collectives of this optimizer, paired with each other "
                        f"({detail}): {_ranks(joined)} ran out of data inside `with opt.join():` and {_are(joined)} "
                        "waiting in the join, which cannot take part in a call that communicates (add_param_group(), "
                        "broadcast_parameters(), broadcast_optimizer_state(), state_dict() with the state sharded) "
                        "that the others made inside the block; make it after the block, where every rank takes part")
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
    blocks = {r: bool(p.get("in_join")) for r, p in sorted(positions.items()) if p is not None}
    inside = [r for r, in_block in blocks.items() if in_block]
    hint = ""
    if inside and len(inside) < len(blocks):
        outside = [r for r in blocks if r not in inside]
        hint = (f". {_ranks(inside).capitalize()} {_are(inside)} inside a join block of this optimizer and "
                f"{_ranks(outside)} {_are(outside)} not: {SAME_JOIN_BLOCK}")
    elif elsewhere and inside:
        hint = (". A rank between steps and not in a collective of this optimizer is busy elsewhere: evaluating, "
                "saving a checkpoint, or in a collective of your own. Every rank is inside `with opt.join():`, "
                "where a collective of your own (a metric's all-reduce, a barrier) cannot run once a rank has run "
                "out of data: that rank waits in the join and cannot take part. Move it after the block")
    elif elsewhere:
        hint = (". A rank between steps and not in a collective of this optimizer is busy elsewhere: "
                "in a collective of your own (a metric's all-reduce after its data ran out: wrap the training "
                "loop in `with opt.join():`), evaluating, or saving a checkpoint")
    return f"{head}; " + "; ".join(lines) + hint


def _limit(progress: Progress) -> str:
    limit = progress.raise_after if progress.raise_after is not None else progress.timeout
    return "past the collective timeout" if limit is None else f"more than {limit:g} s"


def _are(ranks: List[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def closed_members(progress: Progress) -> List[int]:
    """The members whose wrapper of this group was closed (``close()``, or garbage-collected), per the store.

    Empty without a store to read, or when the store does not answer.
    """
    store = _store()
    if store is None:
        return []
    try:
        positions = _positions(progress, store, strict=True)
    except Exception:
        return []
    return [r for r, p in sorted(positions.items()) if r != progress.rank and p is not None and p.get("closed")]


def main_store() -> Any:
    """The main thread's connection to the store, or None without an inspector."""
    return None if _inspector is None else _inspector.store


_store = main_store


def stall_error(progress: Progress, seq: int, what: str, store: Any = None) -> StallError:
    """The :class:`StallError` for collective ``seq``, with the same text on every waiting rank.

    Args:
        progress: this rank's position.
        seq: the collective's number.
        what: the collective, in words.
        store: where the positions are read; the inspector's connection by default.
    """
    store = store if store is not None else _store()
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
    progress.state = _STALLED
    mark_exit(progress.state)
    return StallError(text)


def _gone(progress: Progress, store: Any, window: float) -> Tuple[List[Tuple[int, Dict[str, Any]]], bool]:
    """The members that finished, crashed, were killed or fell silent, and whether the store still answers.

    Each is returned with its last position (or, when the store is gone, what is known of it) and
    ``"how"``: "published" (it said how it ended), "killed" (its pid is gone without a word),
    "closed" (its wrapper was closed while this one's was not), or "silent" (no position for
    longer than the silence threshold). Retried for ``window`` seconds:
    a peer publishes as it leaves, and one killed on another host only falls silent after
    ``_SILENT_TICKS`` ticks. A peer that failed because a peer went away (its published
    ``lost``) is not the cause: while only such are gone, the retries go on for the cause.
    """
    deadline = time.monotonic() + window
    answers = store is not None
    positions: Dict[int, Optional[Dict[str, Any]]] = {}
    closed_since: Dict[int, float] = {}
    while True:
        if answers:
            try:
                positions = _positions(progress, store, strict=True)
            except Exception:  # its host is gone: asking again would only repeat torch's warnings
                answers = False
        now = time.monotonic()
        gone, closed = [], []
        for rank in progress.ranks:
            if rank == progress.rank:
                continue
            position = positions.get(rank)
            if position is not None and position["state"] != "running":
                gone.append((rank, dict(position, how="published")))
            elif _process_ended(position or progress.peers.get(rank)):
                gone.append((rank, dict(position or progress.peers[rank], how="killed", known=position is not None)))
            elif position is not None and position.get("closed"):
                # A rank whose loop ended drops its wrapper just before it finishes: wait for its last word.
                if now - closed_since.setdefault(rank, now) >= _CLOSED_GRACE_TICKS * TICK or now > deadline:
                    closed.append((rank, dict(position, how="closed")))
            elif position is not None and time.time() - position["t"] > _SILENT_TICKS * TICK:
                gone.append((rank, dict(position, how="silent")))
        # Without the store, only a peer on this host can be found gone, and at once: waiting tells nothing.
        if any(not p.get("lost") for _, p in gone) or closed or not answers or now > deadline:
            return sorted(gone + closed), answers
        time.sleep(0.1)


def _on(position: Dict[str, Any]) -> str:
    return "" if position.get("pid") is None else f", on {position['host']} (pid {position['pid']})"


def _last_seen(position: Dict[str, Any], progress: Progress) -> str:
    """Where a peer that ended without a word was last: its position, or a collective it took part in since."""
    if progress.met > position.get("issued", progress.met):
        # A position is published once a tick; a collective that completed here since is later news.
        return (f"last seen at step {progress.met_step}, in {progress.met_what}, which it took part in (its own last "
                f"report, older, said step {position['step']}, {position['phase']})")
    return f"last seen at step {position['step']}, {position['phase']}"


def _gone_text(rank: int, position: Dict[str, Any], progress: Progress) -> str:
    on = _on(position)
    if position.get("failed"):
        if position.get("lost"):  # a consequence: its own collective lost a peer
            return (f"rank {rank} failed too, in {position['failed']} at step {position['failed_step']}, where a peer "
                    f"was gone as well{on}")
        state = position.get("state", "")
        ended = "crashed" if state.startswith("crashed") else state if state.startswith("exited") else "exited"
        return (f"rank {rank} is gone: it {ended} while it waited for the other ranks in {position['failed']} at "
                f"step {position['failed_step']}{on}: {position['error']}")
    if position["how"] == "killed":
        how = "its process ended without saying how (SIGKILL, the out-of-memory killer, os._exit)"
        if not position.get("known", True):
            return f"rank {rank} was killed{on}: {how}; what it was doing is unknown, since the rendezvous store " \
                   "does not answer either"
        return f"rank {rank} was killed{on}, {_last_seen(position, progress)}: {how}"
    if position["how"] == "closed":
        return (f"rank {rank} closed its DistributedOptimizer (close(), or it was garbage-collected there) at step "
                f"{position['step']}{on}, and this rank's is still in use")
    if position["how"] == "silent":
        return (f"rank {rank} stopped answering{on}, {_last_seen(position, progress)}: "
                "it was killed, froze or became unreachable")
    return f"rank {rank} is gone: it {position['state']} after step {position['step']} ({position['phase']}){on}"


def _left(position: Dict[str, Any]) -> bool:
    """A peer that left this optimizer's rounds of its own accord: it finished, or closed its wrapper."""
    return position["how"] == "closed" or (position["how"] == "published" and position["state"] == "finished")


def translate(progress: Progress, seq: int, what: str, exc: BaseException,
              store: Any = None) -> Optional[BaseException]:
    """The error to raise instead of the transport's ``exc`` in collective ``seq``, or None to keep it.

    A timeout becomes :class:`StallError`. A failure caused by a peer that went away
    names that peer (its host and pid, where known), how it ended and where it was; if
    the peer gave up with :class:`StallError`, this rank raises the same. A peer killed
    on this host is named at once, from its pid, even when the store is gone; one killed
    elsewhere once its position is older than the silence threshold (``_SILENT_TICKS``
    ticks), which this waits for when the link was closed under it.

    Args:
        progress: this rank's position.
        seq: the collective's number.
        what: the collective, in words.
        exc: the transport's error.
        store: where the positions are read; the inspector's connection by default.
    """
    message = str(exc).lower()
    if isinstance(exc, StallError):
        return None
    if any(word in message for word in _TIMEOUT_WORDS):
        return stall_error(progress, seq, what)
    store = store if store is not None else _store()
    if store is None:  # no inspector: nobody published anything to read
        return None
    stalled = f"{_PREFIX}/{progress.group}/stall/{seq}"
    try:
        if store.check([stalled]):
            return StallError(store.get(stalled).decode())
    except Exception:  # the store is gone too; every further call would log torch's warning again
        store = None
    # A link a peer closed may be a peer killed on another host, which shows only as a position that stops
    # changing: wait past the silence threshold for it. Other failures: only for a peer's parting words.
    lost = any(word in message for word in _LOST_WORDS)
    gone, answers = _gone(progress, store, (_SILENT_TICKS + 2) * TICK if lost else 2 * TICK)
    if answers and any(p["state"] == _STALLED for _, p in gone):
        # gloo closes a pair whose wait timed out before that rank writes its stall text, so the check
        # above can come too early; the text is written before the state is, so now it is there.
        with contextlib.suppress(Exception):
            if store.check([stalled]):
                return StallError(store.get(stalled).decode())
    if not answers and _inspector is not None:
        _inspector.stopping.set()  # nothing left to publish to, at exit either
    head = f"rank {progress.rank} could not finish {what} at step {progress.step}: "
    if not gone:
        if not lost or answers:
            return None
        # Peers on this host were checked above and live; the cause is among those that could not be checked.
        unchecked = [r for r in progress.ranks if r != progress.rank
                     and progress.peers.get(r, {}).get("space") != _pid_space()]
        if not unchecked:
            return None
        hosts = sorted({str(progress.peers[r]["host"]) for r in unchecked if r in progress.peers})
        return RuntimeError(
            f"{head}a peer closed its connection, and the rendezvous store does not answer either, so the process "
            "that hosted it (rank 0 when the ranks were started by hand with env://, or torchrun's agent) has "
            f"ended, or the network failed. {_ranks(unchecked).capitalize()}"
            f"{' (on ' + ', '.join(hosts) + ')' if hosts else ''} could not be checked from here: see "
            f"{'its' if len(unchecked) == 1 else 'their'} log, and the kernel's log (dmesg) for the out-of-memory "
            "killer")
    # The rank that was killed or fell silent is the cause; ranks that then failed because of it (a collective
    # of theirs lost a peer too) follow, and the hint is about the cause.
    gone.sort(key=lambda item: (bool(item[1].get("lost")), item[1]["how"] not in ("killed", "silent"), item[0]))
    causes = [(r, p) for r, p in gone if not p.get("lost")] or gone
    hint = ""
    if any(p["how"] in ("killed", "silent") and not p.get("failed") for _, p in causes):
        hint = (". The other ranks cannot go on without it: look in the kernel's log (dmesg) for the out-of-memory "
                "killer, and restart every rank from the last checkpoint (torchrun --max-restarts does)")
    elif progress.in_join and any(_left(p) and not p.get("in_join") for _, p in causes):
        outside = [r for r, p in causes if _left(p) and not p.get("in_join")]
        hint = (f". This rank is inside a join block of this optimizer and {_ranks(outside)} "
                f"{'was' if len(outside) == 1 else 'were'} not when it left: {SAME_JOIN_BLOCK}")
    elif any(p["how"] == "closed" for _, p in causes):
        hint = (". Keep the DistributedOptimizers you step alive on every rank, and close (or drop) them alike "
                "on every rank")
    elif any(p.get("failed") or p.get("state", "").startswith("exited") for _, p in causes):
        # It did not finish: it ended on an error, maybe one caught and turned into sys.exit(1) (Hydra does).
        hint = ". See that rank's output for the cause"
    elif any(p["state"] == "finished" for _, p in causes):
        hint = (". A rank that finishes while others still train leaves them waiting: give every rank the same "
                "number of batches (e.g. DistributedSampler(drop_last=True)), or wrap the loop in "
                "`with opt.join():`")
    elif any(p["state"].startswith("crashed") for _, p in causes):
        hint = ". See that rank's traceback for the cause"
    return RuntimeError(head + "; ".join(_gone_text(r, p, progress) for r, p in gone) + hint)


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
        better = explain(progress, seq, what, exc)
        if better is exc:
            raise
        raise better from exc
    except BaseException as exc:  # KeyboardInterrupt, or sys.exit() from a signal handler: it did not finish
        progress.fail(what, exc)
        raise
    finally:
        progress.end()


def explain(progress: Progress, seq: int, what: str, exc: RuntimeError) -> BaseException:
    """:func:`translate` the transport's ``exc`` in collective ``seq``, and record the result as this rank's failure.

    Returns:
        The error to raise: ``exc`` itself where :func:`translate` keeps it.
    """
    better = translate(progress, seq, what, exc)
    error = exc if better is None else better
    lost = not isinstance(error, StallError) and (
        better is not None or any(word in str(exc).lower() for word in _LOST_WORDS))
    progress.fail(what, error, lost)
    return error
