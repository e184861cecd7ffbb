"""The fork server that workers start from, kept in step with the launching process's environment.

A worker forked from multiprocessing's fork server has the modules the server imported, as the
server imported them. Some read environment variables as they load (torch._dynamo reads
``TORCH_COMPILE_DISABLE``, torch reads ``TORCH_LOGS``, ...), and a spawned worker would import
them under the environment of the launch. :func:`fork_server_context` therefore restarts the
server whenever this process's environment differs from the one the server started with: a
variable set between two launches reaches what the workers of the second imported, as it would
reach a spawned worker's imports.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import threading
from typing import Any, Dict, List

__all__ = ["STARTING", "fork_server_context"]

#: Held while a launch picks how its workers start and starts them, so that no launch in another
#: thread restarts the fork server in between (its workers die with it).
STARTING = threading.Lock()

# Rewritten by pytest at every phase of every test, and read by nothing as it imports: a restart
# for it would cost every test's launch a fresh import of torch.
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})

# The server this module started: its pid, the environment it started with, and the process that started it.
_started: Dict[str, Any] = {}


def _own_child(pid: int) -> bool:
    """Whether ``pid`` is a child of this process (False where that cannot be told: no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
    except (OSError, IndexError):
        return False
    return int(fields[1]) == os.getpid()


def fork_server_context(preload: List[str]) -> Any:
    """The context that starts workers from a fork server started under this process's environment.

    The server is started (with ``preload`` imported) on first use, and started again when the
    environment has changed since, or when it is not the one this module started (another
    library's, whose environment is unknown). A server is only ever stopped by the process
    that started it: a process forked from the launching process inherits the record of its
    parent's server, which is not its own to stop. Call it with :data:`STARTING` held.

    Args:
        preload: the modules the server imports once, for all the workers it forks.

    Returns:
        multiprocessing's ``forkserver`` context; its ``spawn`` context when the server would have to
        be restarted but cannot be: this process has other multiprocessing children, which could
        be the server's (they would die with it), the server is not this process's child, or
        this Python's fork server lacks what the restart relies on.
    """
    ctx = mp.get_context("forkserver")
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    environ = {name: value for name, value in os.environ.items() if name not in _VOLATILE}
    ours = pid is not None and pid == _started.get("pid") and _started.get("owner") == os.getpid()
    if ours and environ == _started.get("environ"):
        return ctx
    if pid is not None:
        if (mp.active_children() or not (ours or _own_child(pid))
                or not callable(getattr(server, "_stop", None))):
            return mp.get_context("spawn")
        # The pipe whose closing ends the server may be held open by a process that one of its
        # workers forked and left behind: a signal ends it at once. It is this process's
        # child, not yet reaped, so the pid is still its own.
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        server._stop()  # closes this process's end of that pipe, reaps the server
    ctx.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()
    _started.update(pid=getattr(server, "_forkserver_pid", None), environ=environ, owner=os.getpid())
    return ctx
