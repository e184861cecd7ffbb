"""Waiting for collectives: the :class:`Handle` of an ``*_async`` call, :func:`synchronize`, :func:`poll`.

Also the job-wide waits, :func:`join` and :func:`barrier`.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .. import collectives, joining
from .agreement import serve_joined
from .basics import _world
from .process_sets import global_process_set, group_of

__all__ = [
    "Handle",
    "synchronize",
    "poll",
    "join",
    "barrier",
]


# ====================================================================== async handles


class Handle:
    """An operation in flight, returned by the ``*_async`` functions.

    Pass it to :func:`synchronize` for the result or to :func:`poll` to ask
    whether it finished.
    """

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Optional[Callable[[], Any]] = finish
        self._result: Any = None

    def done(self) -> bool:
        """Whether the communication has finished (the result may still need :meth:`wait`)."""
        return self._finish is None or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        """Block until the operation finished and return its result; the same result on every call."""
        if self._finish is not None:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._finish = None
            self._works = []
        return self._result


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its output.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The output tensor (a list of tensors for ``grouped_*``).

    Raises:
        TypeError: if ``handle`` is not a :class:`Handle`.
    """
    return _check_handle(handle).wait()


def poll(handle: Handle) -> bool:
    """Whether an asynchronous operation has finished, without blocking.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        True once :func:`synchronize` would not block on communication.

    Raises:
        TypeError: if ``handle`` is not a :class:`Handle`.
    """
    return _check_handle(handle).done()


def _check_handle(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(
            f"handle must be what an hvd.*_async function returned, got {type(handle).__name__}; "
            "for DistributedOptimizer's synchronization call optimizer.synchronize()"
        )
    return handle


def _grouped(handles: List[Handle]) -> Handle:
    return Handle([w for h in handles for w in h._works], lambda: [h.wait() for h in handles])


# ====================================================================== join and barrier


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``, standing in for the others meanwhile.

    As in Horovod, a rank that has run out of data calls ``join()`` and, until
    every rank has, takes part in the other ranks' work with zeros: in the
    gradient all-reduces of their :class:`~distopt.horovod.DistributedOptimizer`
    (which divide by the full world size; then every rank gets the parameters
    and optimizer state of a rank that ran longest, as in
    :meth:`distopt.DistributedOptimizer.join`), and in their ``hvd.allreduce``
    with op Sum or Average (a metric's average counts the joined ranks' zeros).
    Any other ``hvd`` tensor collective on the global process set while a rank
    has joined raises ``RuntimeError`` on every active rank, as Horovod's does.
    Object collectives and :func:`barrier` wait for the joined rank: call them
    after ``join()``.

    Args:
        device: ignored (Horovod's GPU for the join's zero tensors).

    Returns:
        The last rank to join (the same on every rank).
    """
    from .optimizer import _live_optimizers

    group = _world()
    if group is None or dist.get_world_size(group) == 1:
        return 0
    optimizers = _live_optimizers()
    if not optimizers:
        return serve_joined(group)
    # The optimizers' rounds and the hvd collectives run on different groups, in an order only the
    # active ranks know: serve both at once.
    served: List[Any] = []
    thread = threading.Thread(target=lambda: served.append(_capture(serve_joined, group)),
                              name="distopt-hvd-join", daemon=True)
    thread.start()
    last = joining.join_and_wait(optimizers)  # if it raises, the daemon thread is left to the job's end
    thread.join()
    outcome, value = served[0]
    if outcome == "error":
        raise value
    return last


def _capture(fn: Callable[..., Any], *args: Any) -> Tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except BaseException as error:  # re-raised on the calling thread
        return "error", error


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank reaches this call.

    Args:
        process_set: the ranks to wait for (default: all).
    """
    collectives.barrier(group_of(process_set))
