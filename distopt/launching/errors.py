"""The errors :func:`~distopt.launching.launch` raises when its workers do not all succeed.

:class:`WorkerFailedError` names the worker that failed first and carries its
traceback; :class:`WorkerFailure` records how each failed worker ended.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import List, Optional, Sequence

__all__ = ["LaunchError", "WorkerFailure", "WorkerFailedError", "LaunchTimeoutError"]


#: What a worker's traceback says when a peer's death made it fail (gloo, NCCL, distopt's stall inspector).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "is gone: it")


class LaunchError(RuntimeError):
    """Base class of the errors :func:`launch` raises when its workers do not all succeed."""


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker failed.

    Attributes:
        rank: global rank of the worker.
        local_rank: index of the worker on this node.
        exitcode: the process exit code; negative for a signal, ``None`` if it
            was still running when the failure was reported.
        traceback: the worker's formatted Python traceback, or ``None`` when it
            died without raising (``os._exit``, a signal, a crash).
        when: ``time.time()`` at which the failure happened or was noticed.
        started: whether the worker got as far as distopt's entry point (past
            importing the main module and the spawn start-up).
    """

    rank: int
    local_rank: int
    exitcode: Optional[int]
    traceback: Optional[str]
    when: float
    started: bool = True

    @property
    def caused_by_a_peer(self) -> bool:
        """Whether its traceback says that it failed because a peer went away first (the transport's
        lost connection, or distopt's stall inspector naming a rank that is gone)."""
        return self.traceback is not None and any(mark in self.traceback for mark in _PEER_LOST)

    @property
    def signal_name(self) -> Optional[str]:
        """Name of the signal that killed the worker (``"SIGKILL"``), or ``None``."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        """One line: what happened to this worker."""
        if self.signal_name is not None:
            how = f"was killed by {self.signal_name}"
        elif self.traceback is not None:
            last = self.traceback.strip().splitlines()[-1] if self.traceback.strip() else "an exception"
            how = f"raised {last}"
            if self.exitcode is not None:
                how += f" (exit code {self.exitcode})"
        elif self.exitcode is not None:
            how = f"exited with code {self.exitcode}"
        else:
            how = "failed"
        return f"worker rank {self.rank} (local rank {self.local_rank}) {how}"


class WorkerFailedError(LaunchError):
    """A worker raised, exited non-zero or was killed; all other workers were terminated.

    Attributes:
        rank: global rank of the worker that failed first.
        exitcode: its exit code (negative: killed by signal ``-exitcode``).
        signal_name: the signal's name (``"SIGKILL"``) when it was killed, else ``None``.
        traceback: the worker's Python traceback, or ``None`` when it died without raising.
        failures: every failure noticed, the first one first.
    """

    def __init__(self, failures: Sequence[WorkerFailure]) -> None:
        first = failures[0]
        self.failures: List[WorkerFailure] = list(failures)
        self.rank: int = first.rank
        self.exitcode: Optional[int] = first.exitcode
        self.signal_name: Optional[str] = first.signal_name
        self.traceback: Optional[str] = first.traceback
        lines = [first.describe() + "; the other workers were terminated."]
        if first.traceback:
            lines += [f"Traceback of rank {first.rank}:", first.traceback.rstrip()]
        elif not first.started:
            lines.append(
                "It died while starting, before fn ran; its output above says why. A script that calls "
                "launch must do so under `if __name__ == \"__main__\":`, since workers re-import it."
            )
        else:
            lines.append("It left no Python traceback (os._exit, a signal or a crash); check its output above.")
        for other in failures[1:]:
            lines.append(f"Also: {other.describe()}.")
        super().__init__("\n".join(lines))


class LaunchTimeoutError(LaunchError):
    """The workers did not all finish within ``timeout``; all of them were killed.

    Attributes:
        timeout: the limit in seconds.
        running: global ranks still running when the limit was reached.
    """

    def __init__(self, timeout: float, running: Sequence[int], finished: Sequence[int]) -> None:
        self.timeout = timeout
        self.running = list(running)
        super().__init__(
            f"launch timed out after {timeout:g} s: ranks {self.running} were still running "
            f"(ranks {list(finished)} had finished) and all were killed. Pass a larger timeout= "
            "if the work needs longer, or look for a hang such as a collective that not every rank calls."
        )
