"""What the shaped link really carries: a bulk TCP transfer and small round trips between the two hosts.

The check an ``iperf`` run would make, in a few lines of sockets: the receiver
times ``nbytes`` from the first byte to the last (the payload rate, which tbf caps
at about 95.6% of the stated rate since it counts every frame's headers), then
echoes one-byte messages for the round-trip time. Each rank's host runs its half
(:mod:`.host`), the supervisor both directions in turn.
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Dict

__all__ = ["serve", "send", "PINGS"]

#: One-byte round trips after the bulk transfer; their median is the reported round-trip time.
PINGS = 20
_CHUNK = 1 << 20


def serve(address: str, port: int, nbytes: int, timeout: float = 60.0) -> Dict[str, float]:
    """Receive ``nbytes`` on ``address:port`` and time them; then echo :data:`PINGS` one-byte messages.

    Args:
        address: this host's address.
        port: the port to listen on.
        nbytes: bytes the sender sends.
        timeout: seconds to wait for the sender, and for each read.

    Returns:
        ``{"mbit_s": payload megabits per second, "bytes": bytes received}``.
    """
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1)
        listener.settimeout(timeout)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            got, first = 0, None
            while got < nbytes:
                data = conn.recv(_CHUNK)
                if not data:
                    break
                if first is None:
                    first = time.perf_counter()
                got += len(data)
            seconds = time.perf_counter() - (first or time.perf_counter())
            conn.sendall(b"k")
            for _ in range(PINGS):
                conn.sendall(conn.recv(1))
    return {"mbit_s": got * 8 / seconds / 1e6 if seconds > 0 else float("nan"), "bytes": float(got)}


def send(address: str, port: int, nbytes: int, timeout: float = 60.0) -> Dict[str, float]:
    """Connect to ``address:port`` (retrying while the receiver starts), send ``nbytes``, then time round trips.

    Args:
        address: the receiver's address.
        port: its port.
        nbytes: bytes to send.
        timeout: seconds to keep trying to connect, and for each read.

    Returns:
        ``{"rtt_ms": the median round-trip time of a one-byte message}``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        block = bytes(_CHUNK)
        sent = 0
        while sent < nbytes:
            piece = min(_CHUNK, nbytes - sent)
            conn.sendall(block[:piece])
            sent += piece
        conn.recv(1)
        rtts = []
        for _ in range(PINGS):
            start = time.perf_counter()
            conn.sendall(b"p")
            conn.recv(1)
            rtts.append(time.perf_counter() - start)
    return {"rtt_ms": statistics.median(rtts) * 1e3}
