"""Waiting for one of the engine's all-reduces: bounded, watched for stalls, with errors explained.

The engine waits in one place (:meth:`distopt.engine.engine.RoundEnd.wait`),
pack by pack, through :func:`wait_for`. A gloo wait is cut into slices so that
it can give up at the end of backward (the round stays pending) and raise
:class:`distopt.StallError` at the stall timeout; a collective that fails
because a peer went away is explained by :func:`distopt.transport.stalls.translate`.
A CUDA (NCCL) wait only orders the streams, so it is never cut: the stall
inspector watches such a work from its thread instead.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional

from . import stalls
from .stalls import Progress

__all__ = ["wait_for", "completed_failure"]


def completed_failure(work: Any) -> Optional[RuntimeError]:
    """The error a completed ``work`` failed with, or None if it succeeded.

    A wait with a timeout that runs out raises, and the work may complete in the instant
    before ``is_completed()`` is asked: only a wait without a timeout, on a work that is
    completed, tells a failure from a timeout.
    """
    try:
        work.wait()
    except RuntimeError as exc:
        return exc
    return None


def wait_for(work: Any, is_cuda: bool, progress: Optional[Progress], seq: int, what: str,
             deadline: Optional[float], from_every_rank: bool = False) -> bool:
    """Wait for ``work``, collective number ``seq`` of the wrapper's group.

    Args:
        work: the all-reduce's work handle.
        is_cuda: its tensor is on a GPU (NCCL): wait without a timeout.
        progress: this rank's position, or None (no inspector: a plain wait).
        seq: the collective's number, for the inspector.
        what: the collective, in words.
        deadline: ``time.perf_counter()`` at which to give up, or None.
        from_every_rank: every member contributes to the collective (an all-reduce, an all-gather;
            not a broadcast, whose root is done once it has sent): once it completes, every member
            is known to have issued it (:meth:`Progress.meet`), news that may be later than a
            killed peer's last published position.

    Returns:
        False if it gave up at ``deadline``: the all-reduce goes on.

    Raises:
        StallError: the wait passed ``progress.raise_after``, or the collective hit the
            group's timeout.
        RuntimeError: the collective failed; names the peer that went away, when known.

    Whatever leaves it raising is this rank's failure (:meth:`Progress.fail`), for the peers.
    """
    if progress is None or is_cuda:
        work.wait()
        if progress is not None:  # the stream waits, not the host: the inspector watches the work
            progress.cuda_works.append((seq, what, time.monotonic(), work))
        return True
    progress.begin(seq, what)
    try:
        while True:
            limits = []
            if deadline is not None:
                limits.append(deadline - time.perf_counter())
            if progress.raise_after is not None:
                limits.append(progress.raise_after - progress.waited())
            try:
                if limits:
                    work.wait(timeout=timedelta(seconds=max(min(limits), 0.001)))
                else:
                    work.wait()
                break
            except RuntimeError as exc:
                if work.is_completed():
                    failure = completed_failure(work)
                    if failure is None:  # it completed just after the slice ran out: not a failure
                        break
                    # The collective itself failed: a peer left, or the group's timeout.
                    better = stalls.explain(progress, seq, what, failure)
                    if better is failure:
                        raise failure from exc
                    raise better from failure
            if progress.raise_after is not None and progress.waited() >= progress.raise_after:
                error = stalls.stall_error(progress, seq, what)
                progress.fail(what, error)
                raise error
            if deadline is not None and time.perf_counter() >= deadline:
                return False
    except (KeyboardInterrupt, SystemExit) as exc:  # sys.exit() from a signal handler: it did not finish
        progress.fail(what, exc)
        raise
    finally:
        progress.end()
    if from_every_rank:
        progress.meet(seq, what)
    return True
