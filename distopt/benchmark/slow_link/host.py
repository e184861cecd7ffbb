"""A rank's host: one long-lived process per namespace that forks a process per contender and relays.

The supervisor starts one per namespace (``ip netns exec <ns> python -m
distopt.benchmark.slow_link.host --core N``). It pins itself to its core, imports torch and
the benchmark once, and then forks each contender's process (:mod:`.child`) from
that state: a fork costs milliseconds where a fresh interpreter costs seconds, and
the children inherit the namespace and the core.

Messages are pickled objects framed as :mod:`multiprocessing.connection` frames them,
on the host's stdin (from the supervisor) and on its original stdout (to it); the
host's own stray output goes to stderr, a log file. From the supervisor:

* ``("start", key, job)``: fork the contender ``key`` with :class:`~.child.Job` ``job``.
* ``("to", key, message)``: pass a command on to contender ``key``.
* ``("kill", key)``: SIGKILL contender ``key`` (its peer failed or hung).
* ``("probe", "serve" | "send", address, port, nbytes)``: half of the link check (:mod:`.probe`).
* ``("exit",)``, or the pipe closing: kill every contender and exit.

To the supervisor, ``(key, message)``: every message of contender ``key`` as it comes,
and, when its process ends for any reason, ``(key, ("gone", exitcode, telling line of
its log))``. Replies of the host itself have key None.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["main", "telling_line"]

# Words that mark the line of a log that says why a process died, most telling first.
_TELLING = ("mismatch", "what():", "Error", "error", "Exception", "Aborted", "Killed")


def telling_line(log: str, limit: int = 300) -> str:
    """The line of a dead process's log that best says why it died.

    The last line holding the most telling of: gloo's ``collective mismatch``, a C++
    exception's ``what():``, a Python exception's type; else the last line.

    Args:
        log: the log's text (its end is enough).
        limit: the longest line returned; a longer one is cut, with ``...``.

    Returns:
        The line, stripped; ``""`` for an empty log.
    """
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    for word in _TELLING:
        hits = [candidate for candidate in lines if word in candidate]
        if hits:
            line = hits[-1]
            break
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _log_tail(path: str, size: int = 16384) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class _Child:
    process: Any  # multiprocessing's fork Process
    conn: Optional[Connection]  # None once it reached end of file
    log_path: str


def _drain(key: str, child: _Child, outbox: Connection) -> None:
    """Forward what the child sent before it ended, then forget its pipe."""
    if child.conn is None:
        return
    try:
        while child.conn.poll():
            outbox.send((key, child.conn.recv()))
    except (EOFError, OSError):
        pass
    child.conn.close()
    child.conn = None


def _prewarm() -> None:
    """Import once, before any fork, what every contender's process would otherwise import itself.

    Building the first optimizer imports ``torch._dynamo`` (over a second on the development
    machine), and the DDP hooks and distopt's compressors are imported on first use; done
    here, each contender's process starts with them, and starting 18 contenders takes
    seconds instead of a minute. Nothing here starts a thread (one intra-op thread), so
    forking afterwards stays safe.
    """
    import torch
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks  # noqa: F401
    import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook  # noqa: F401
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook  # noqa: F401
    import torch.distributed.algorithms.model_averaging.averagers  # noqa: F401
    import torch.distributed.optim  # noqa: F401

    from ... import compression  # noqa: F401

    weight = torch.zeros(1, requires_grad=True)
    for make in (torch.optim.SGD, torch.optim.AdamW):
        make([weight], lr=0.1)


def _serve(inbox: Connection, outbox: Connection) -> None:
    # Imported here, after the core is pinned and the pipes are set: these pull in torch.
    from . import probe
    from .child import contender_main

    _prewarm()

    context = multiprocessing.get_context("fork")
    children: Dict[str, _Child] = {}
    outbox.send((None, ("hello", {"pid": os.getpid()})))
    try:
        while True:
            waitables: List[Any] = [inbox]
            waitables += [c.conn for c in children.values() if c.conn is not None]
            waitables += [c.process.sentinel for c in children.values()]
            for ready in wait(waitables):
                if ready is inbox:
                    try:
                        message = inbox.recv()
                    except EOFError:
                        return  # the supervisor is gone
                    kind = message[0]
                    if kind == "exit":
                        return
                    if kind == "start":
                        key, job = message[1], message[2]
                        ours, theirs = context.Pipe()
                        process = context.Process(target=contender_main, args=(theirs, job), name=key)
                        process.start()
                        theirs.close()
                        children[key] = _Child(process, ours, job.log_path)
                    elif kind == "to":
                        child = children.get(message[1])
                        if child is not None and child.conn is not None:
                            try:
                                child.conn.send(message[2])
                            except OSError:
                                pass  # it is ending: its sentinel reports it
                    elif kind == "kill":
                        child = children.get(message[1])
                        if child is not None and child.process.is_alive():
                            child.process.kill()
                    elif kind == "probe":
                        role, address, port, nbytes = message[1:]
                        try:
                            result = (probe.serve if role == "serve" else probe.send)(address, port, nbytes)
                            outbox.send((None, ("probe", result)))
                        except OSError as exc:
                            outbox.send((None, ("probe-error", f"{type(exc).__name__}: {exc}")))
                    continue
                for key, child in list(children.items()):
                    if ready is child.conn:
                        try:
                            outbox.send((key, child.conn.recv()))
                        except (EOFError, OSError):
                            child.conn.close()
                            child.conn = None
                    elif ready == child.process.sentinel:
                        _drain(key, child, outbox)
                        child.process.join()
                        tail = telling_line(_log_tail(child.log_path))
                        outbox.send((key, ("gone", child.process.exitcode, tail)))
                        del children[key]
    finally:
        for child in children.values():
            if child.process.is_alive():
                child.process.kill()
        for child in children.values():
            child.process.join()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The host process: pin to ``--core``, then serve the supervisor on stdin/stdout until told to exit.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(prog="python -m distopt.benchmark.slow_link.host")
    parser.add_argument("--core", type=int, required=True, help="the CPU core this rank and its contenders run on")
    args = parser.parse_args(argv)
    from .child import die_with_parent

    die_with_parent()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})  # the contenders' processes inherit it
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    # From here on the protocol owns the original stdin/stdout; anything printed goes to the log.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the host ends
    import torch

    torch.set_num_threads(1)
    _serve(inbox, outbox)
    return 0


if __name__ == "__main__":
    sys.exit(main())
