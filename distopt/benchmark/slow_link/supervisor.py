"""The launching side: the rank hosts in their namespaces, and one request at a time to a contender.

:class:`Supervisor` starts one :mod:`.host` per rank (``ip netns exec``), ``ranks_per_host`` of
them in each namespace (ranks ``0 .. k - 1`` in the first, ``k .. 2k - 1`` in the second), each in
a session of its own, and ends them (and through them every contender's process) on
leaving its ``with`` block, also on an exception or Ctrl-C: first by asking, then by
``SIGKILL`` to the session. The hosts and the contenders also die with their parent
(``PR_SET_PDEATHSIG``), so even a killed benchmark leaves no process behind.

A contender lives on every host under one key. :meth:`Supervisor.request` sends a
command to all of its processes and waits for one reply from each. When one side
fails (it died, raised, or its construction raised), the other is probably waiting in
a collective for it, so it is killed rather than left to time out; when neither
answers within the deadline, both are. The caller gets both replies and decides.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .child import Job
from .namespaces import Host, ShapedLink

__all__ = ["Supervisor", "HostError", "FAILURES", "describe_failure"]

#: Replies that mean the contender's process on that rank is finished.
FAILURES = ("gone", "error", "unavailable", "hung")

# Seconds to wait for a host to import torch and say hello.
_HELLO_TIMEOUT_S = 180.0
# Seconds a host is given to end its contenders and exit before its session is killed.
_EXIT_GRACE_S = 5.0


class HostError(RuntimeError):
    """A rank's host died or stopped answering: the run cannot go on."""


def _package_root() -> str:
    # The directory holding the distopt package, for the hosts' PYTHONPATH.
    return str(Path(__file__).resolve().parents[3])


def describe_failure(reply: Tuple[Any, ...]) -> str:
    """A failed reply in words: ``"killed by SIGABRT: <log line>"``, ``"ValueError: ..."``, ``"no reply in 300 s"``.

    Args:
        reply: a reply whose kind is in :data:`FAILURES`.

    Returns:
        The reason, for the report.
    """
    kind = reply[0]
    if kind == "gone":
        code, line = reply[1], reply[2]
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return f"{how}: {line}" if line else how
    if kind == "hung":
        return f"no reply in {reply[1]:.0f} s"
    return str(reply[1])


class Supervisor:
    """The rank hosts, ``ranks_per_host`` in each namespace of ``link``, pinned to ``cores``.

    Args:
        link: the built link.
        cores: the core of each rank.
        log_dir: where the hosts' and contenders' logs go.
        ranks_per_host: ranks in each namespace; they reach each other over its loopback.

    Raises:
        ValueError: ``cores`` does not give one core per rank.
    """

    def __init__(self, link: ShapedLink, cores: Sequence[int], log_dir: Path, ranks_per_host: int = 1) -> None:
        self.link = link
        self.cores = list(cores)
        self.log_dir = log_dir
        self.ranks_per_host = ranks_per_host
        self.world = len(link.hosts) * ranks_per_host
        if len(self.cores) != self.world:
            raise ValueError(f"cores={self.cores!r} must give one core per rank: {self.world} of them")
        self._procs: List[subprocess.Popen] = []
        self._to: List[Connection] = []
        self._from: List[Connection] = []
        self._gone: Dict[Tuple[str, int], Tuple[Any, ...]] = {}
        self._host_replies: Dict[int, List[Tuple[Any, ...]]] = {}  # the hosts' own replies, not yet taken

    def __enter__(self) -> "Supervisor":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start both hosts and wait for their hello.

        Raises:
            HostError: a host did not start.
        """
        for rank in range(self.world):
            host = self.host_of(rank)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
            env["GLOO_SOCKET_IFNAME"] = host.interface  # gloo would otherwise look up the host name
            env["OMP_NUM_THREADS"] = "1"
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(name, None)
            to_host, from_host = os.pipe(), os.pipe()
            with open(self.log_dir / f"host{rank}.log", "wb") as log:
                proc = subprocess.Popen(
                    [*self.link.exec_prefix(host), sys.executable, "-m", "distopt.benchmark.slow_link.host",
                     "--core", str(self.cores[rank])],
                    stdin=to_host[0], stdout=from_host[1], stderr=log, env=env, start_new_session=True)
            os.close(to_host[0])
            os.close(from_host[1])
            self._procs.append(proc)
            self._to.append(Connection(to_host[1], readable=False))
            self._from.append(Connection(from_host[0], writable=False))
        for rank in range(self.world):
            self._host_reply(rank, "hello", _HELLO_TIMEOUT_S)

    def host_of(self, rank: int) -> Host:
        """The namespace end ``rank`` runs in: ranks are numbered one namespace after the other."""
        return self.link.hosts[rank // self.ranks_per_host]

    def _log(self, rank: int) -> str:
        try:
            return (self.log_dir / f"host{rank}.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _receive(self, timeout: float) -> List[Tuple[int, Optional[str], Tuple[Any, ...]]]:
        """Messages that arrive within ``timeout`` seconds: ``(rank, key, message)``."""
        out = []
        for conn in wait(self._from, max(0.0, timeout)):
            rank = self._from.index(conn)  # type: ignore[arg-type]
            try:
                key, message = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                raise HostError(f"the host of rank {rank} died; its log ends:\n{self._log(rank)}") from None
            if key is None:
                self._host_replies.setdefault(rank, []).append(message)
                continue
            if message[0] == "gone":
                self._gone[(key, rank)] = message
            out.append((rank, key, message))
        return out

    def _host_reply(self, rank: int, kind: str, timeout: float) -> Tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            for message in self._host_replies.pop(rank, []):
                if message[0] == f"{kind}-error":
                    raise HostError(f"rank {rank}'s {kind} failed: {message[1]}")
                if message[0] == kind:
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HostError(f"the host of rank {rank} sent no {kind!r} in {timeout:.0f} s; its log ends:\n"
                                f"{self._log(rank)}")
            self._receive(remaining)

    def _send(self, rank: int, message: Tuple[Any, ...]) -> None:
        try:
            self._to[rank].send(message)
        except OSError:
            raise HostError(f"the host of rank {rank} died; its log ends:\n{self._log(rank)}") from None

    def probe(self, sender: int, receiver: int, port: int, nbytes: int) -> Dict[str, float]:
        """One direction of the link check: ``sender`` sends ``nbytes`` over TCP to ``receiver``.

        Returns:
            The receiver's payload rate (``mbit_s``) and the sender's round-trip time (``rtt_ms``).
        """
        address = self.host_of(receiver).address
        self._send(receiver, ("probe", "serve", address, port, nbytes))
        self._send(sender, ("probe", "send", address, port, nbytes))
        return {**self._host_reply(receiver, "probe", 300)[1], **self._host_reply(sender, "probe", 300)[1]}

    def start_contender(self, key: str, jobs: Sequence[Job], timeout: float) -> List[Tuple[Any, ...]]:
        """Fork contender ``key`` on every rank's host (``jobs[rank]``) and wait for each to be ready or fail."""
        for rank, job in enumerate(jobs):
            self._send(rank, ("start", key, job))
        return self._collect(key, timeout)

    def request(self, key: str, command: Tuple[Any, ...], timeout: float) -> List[Tuple[Any, ...]]:
        """Send ``command`` to contender ``key`` on every rank; one reply per rank (see the module)."""
        for rank in range(self.world):
            if (key, rank) not in self._gone:
                self._send(rank, ("to", key, command))
        return self._collect(key, timeout)

    def kill(self, key: str) -> None:
        """SIGKILL contender ``key`` on every rank where it still runs, and wait until each is gone."""
        for rank in range(self.world):
            if (key, rank) not in self._gone:
                self._send(rank, ("kill", key))
        deadline = time.monotonic() + 30
        while any((key, rank) not in self._gone for rank in range(self.world)) and time.monotonic() < deadline:
            self._receive(deadline - time.monotonic())

    def _collect(self, key: str, timeout: float) -> List[Tuple[Any, ...]]:
        replies: List[Optional[Tuple[Any, ...]]] = [self._gone.get((key, rank)) for rank in range(self.world)]
        deadline = time.monotonic() + timeout
        killed = False
        while any(reply is None for reply in replies):
            if not killed and any(reply is not None and reply[0] in FAILURES for reply in replies):
                # Its peer is probably blocked in a collective with it: end it now.
                for rank in range(self.world):
                    if replies[rank] is None:
                        self._send(rank, ("kill", key))
                killed = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill(key)
                return [reply if reply is not None else ("hung", timeout) for reply in replies]
            for rank, k, message in self._receive(remaining):
                if k == key and replies[rank] is None:
                    replies[rank] = message
        return replies  # type: ignore[return-value]

    def close(self) -> None:
        """Ask the hosts to exit, then kill their sessions; wait for every process. Safe to call twice."""
        for conn in self._to:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        deadline = time.monotonic() + _EXIT_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            # The host's session: the host and every contender it forked, even if the host itself is gone.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for conn in self._to + self._from:
            conn.close()
        self._procs, self._to, self._from = [], [], []
