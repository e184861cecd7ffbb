"""Cutting a failed gloo group's connections, so that no peer waits out a timeout.

On CPU, ``abort()`` of a gloo process group does not interrupt a collective in
flight: it blocks until the collective ends, i.e. until gloo's timeout (measured on
torch 2.13: a 5 s timeout, abort returned after 5.0 s). A replica that saw a peer die
therefore cannot free the others, and a survivor that was waiting for *it* (not for the
dead peer) would wait out the whole timeout.

The smallest replacement: note which TCP connections the gloo group opened when it was
built (the sockets that appeared while it connected, less listeners and the store's own
connections), and on the first error ``shutdown()`` them. Every peer waiting on this
replica then reads end-of-file at once and fails too, and cuts its own connections in
turn, so one error reaches every survivor within milliseconds. Only ``shutdown`` is
called, never ``close``: gloo still owns the descriptors and closes them when the group
is destroyed; a descriptor is cut only while it still names the same socket.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, Optional

__all__ = ["Sockets", "open_sockets", "connections_since"]

#: A process's descriptors that are sockets: descriptor -> "socket:[inode]".
Sockets = Dict[int, str]


def open_sockets() -> Sockets:
    """This process's socket descriptors now (Linux: ``/proc/self/fd``; elsewhere empty)."""
    found: Sockets = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def connections_since(before: Sockets, exclude_port: Optional[int]) -> Sockets:
    """The connected TCP sockets opened since ``before``, less listeners and ``exclude_port``'s.

    Args:
        before: :func:`open_sockets` taken before the group connected.
        exclude_port: a local port whose connections are not the group's (the store this
            process serves, whose accepted connections share the window), or None.
    """
    chosen: Sockets = {}
    for fd, target in open_sockets().items():
        if before.get(fd) == target:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # a listener: shutting it down kills gloo's accept loop (the process aborts)
            if exclude_port is not None and sock.getsockname()[1] == exclude_port:
                continue
            sock.getpeername()  # connected
        except OSError:
            continue
        finally:
            sock.close()  # the duplicate only
        chosen[fd] = target
    return chosen


def cut(connections: Sockets) -> int:
    """``shutdown()`` every connection of ``connections`` still open as the same socket; return how many."""
    now = open_sockets()
    done = 0
    for fd, target in connections.items():
        if now.get(fd) != target:
            continue  # closed (and perhaps reused) since
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.close()
    return done


__all__.append("cut")
