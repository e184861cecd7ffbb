"""The background thread that runs ``hvd`` tensor collectives, and the names of those in flight.

As in Horovod, an ``*_async`` call returns at once: the collective (its
announcement, see :mod:`.agreement`, then the operation itself) is started by
one background thread, in the order this rank submitted them, so a rank can
issue an operation that the others reach only later, after a barrier, say. The
thread runs on a *lane*: a group of the same ranks used by nothing else
(:func:`~.process_sets.lane_of`), so that it never pairs with a collective the
calling thread runs meanwhile (a barrier, an object collective, the user's own).

Also Horovod's rule for names: a second operation with the name of one still
in flight on this rank raises ``ValueError``.
"""
from __future__ import annotations

import contextvars
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .errors import internal_errors

__all__ = ["Handle"]  # the rest is the machinery of the collectives here

#: What a launch returns: the works to wait for, and what turns them into the result.
Launched = Tuple[List[Any], Callable[[], Any]]

_lock = threading.RLock()
_in_flight: Dict[str, Handle] = {}
_worker: Optional["_Worker"] = None
_name: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar("distopt_hvd_name", default=None)


class Handle:
    """An operation in flight, returned by the ``*_async`` functions.

    Pass it to :func:`~distopt.horovod.synchronize` for the result or to
    :func:`~distopt.horovod.poll` to ask whether it finished.

    Example::

        >>> handle = hvd.allreduce_async(loss.detach(), name="loss")
        >>> ...  # the collective runs meanwhile
        >>> mean_loss = hvd.synchronize(handle)
    """

    def done(self) -> bool:
        """Whether the communication has finished (the result may still need :meth:`wait`)."""
        raise NotImplementedError

    def wait(self) -> Any:
        """Block until the operation finished and return its result; the same result on every call.

        Raises:
            HorovodInternalError: the collective failed (e.g. the ranks' tensors differ), as Horovod's do.
            ValueError: the arguments cannot work on any rank (checked before anything is sent).
        """
        raise NotImplementedError


class _Started(Handle):
    """A collective submitted to the background thread; its launch may not have run yet."""

    def __init__(self, pending: "Future[Launched]") -> None:
        self._pending = pending
        self._works: List[Any] = []
        self._finish: Optional[Callable[[], Any]] = None
        self._launched = False
        self._finished = False
        self._result: Any = None

    def _take(self) -> None:
        if not self._launched:
            self._works, self._finish = self._pending.result()  # the launch's error is raised here
            self._works = [w for w in self._works if w is not None]
            self._launched = True

    def done(self) -> bool:
        if self._finished:
            return True
        if not self._pending.done():
            return False
        if self._pending.exception() is not None:
            return True
        self._take()
        return all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._finished:
            with internal_errors():  # a failed collective is Horovod's HorovodInternalError
                self._take()
                for work in self._works:
                    work.wait()
                self._result = self._finish() if self._finish is not None else None
            self._finished, self._works, self._finish = True, [], None
        return self._result


class _Grouped(Handle):
    def __init__(self, handles: List[Handle]) -> None:
        self._handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> List[Any]:
        return [h.wait() for h in self._handles]


class _Then(Handle):
    def __init__(self, handle: Handle, then: Callable[[Any], Any]) -> None:
        self._handle, self._then = handle, then
        self._finished, self._result = False, None

    def done(self) -> bool:
        return self._handle.done()

    def wait(self) -> Any:
        if not self._finished:
            self._result, self._finished = self._then(self._handle.wait()), True
        return self._result


def grouped(handles: List[Handle]) -> Handle:
    """One handle for several: done when all are, waiting returns their results in order."""
    return _Grouped(list(handles))


def then(handle: Handle, fn: Callable[[Any], Any]) -> Handle:
    """A handle whose result is ``fn`` of ``handle``'s."""
    return _Then(handle, fn)


def start(launch: Callable[[], Launched], background: bool) -> Handle:
    """Run ``launch`` (announce, check, issue) on the background thread, or here if not ``background``.

    Args:
        launch: starts the collective and returns ``(works, finish)``; runs on the
            background thread, in submission order.
        background: False for a job of one process, where nothing is sent.
    """
    pending: "Future[Launched]" = Future()
    if background:
        _the_worker().submit(pending, launch)
    else:
        _run(pending, launch, None)
    return _Started(pending)


def named(name: Optional[str], make: Callable[[], Any]) -> Any:
    """``make()``, unless an operation called ``name`` is still in flight on this rank.

    The collectives ``make`` starts announce ``name`` (:func:`current_name`), so that ranks
    issuing differently named operations at the same point fail instead of pairing them.
    A :class:`Handle` it returns holds the name until it finishes.

    Raises:
        ValueError: one is (Horovod's rule).
    """
    if name is None:
        return make()
    name = str(name)
    with _lock:
        for other in [n for n, h in _in_flight.items() if h.done()]:
            del _in_flight[other]
        if name in _in_flight:
            raise ValueError(
                f"an operation named {name!r} is still in flight on this rank; wait for it with "
                "hvd.synchronize(handle) first, or give the new one another name"
            )
    token = _name.set(name)
    try:
        result = make()  # outside the lock: a synchronous one waits for its collective here
    finally:
        _name.reset(token)
    if isinstance(result, Handle):
        with _lock:
            _in_flight[name] = result
    return result


def current_name() -> Optional[str]:
    """The ``name=`` of the operation being started on this thread, if any."""
    return _name.get()


def stop() -> None:
    """Stop the background thread (at shutdown) once what was submitted has started."""
    global _worker
    with _lock:
        worker, _worker = _worker, None
        _in_flight.clear()
    if worker is not None:
        worker.stop()


class _Worker:
    def __init__(self) -> None:
        self.queue: "queue.SimpleQueue[Optional[Tuple[Future, Callable[[], Launched], Any]]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="distopt-hvd-background", daemon=True)
        self.thread.start()

    def submit(self, pending: "Future[Launched]", launch: Callable[[], Launched]) -> None:
        # The caller's GPU and stream: the collective is ordered after the work that made its tensors.
        stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.queue.put((pending, launch, stream))

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            _run(*item)
            # Not kept while waiting for the next: the launch's closure holds its group, which a
            # script that never calls hvd.shutdown() would keep alive past the group's destruction at exit.
            del item

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10.0)  # a collective some rank never joins would keep it: it is a daemon


def _run(pending: "Future[Launched]", launch: Callable[[], Launched], stream: Any) -> None:
    if not pending.set_running_or_notify_cancel():
        return
    try:
        if stream is None:
            result = launch()
        else:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                result = launch()
    except BaseException as error:  # raised where the handle is waited for
        pending.set_exception(error)
    else:
        pending.set_result(result)


def _the_worker() -> _Worker:
    global _worker
    with _lock:
        if _worker is None:
            _worker = _Worker()
        return _worker
