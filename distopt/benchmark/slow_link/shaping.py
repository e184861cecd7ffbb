"""The token-bucket filter that shapes each end of the veth pair: ``tc qdisc ... tbf``.

``tbf`` is used because it works on every kernel that has it built in (``netem``, which
could also add delay, is not built into every kernel, e.g. not on the development
machine). Its three numbers:

* ``rate``: the stated link rate. tbf counts whole frames (Ethernet, IP and TCP
  headers too), so TCP's payload reaches about 1448/1514 = 95.6% of it.
* ``burst``: how many bytes may leave at once when tokens have piled up. Too small,
  and the rate is not reached, because the kernel refills the bucket and wakes the
  queue on timer ticks (4 ms at ``CONFIG_HZ=250``), not continuously; too large, and
  short transfers run at memory speed. One tick's worth of the rate, and at least
  16 KiB, reached the payload ceiling on the development machine (20 MiB over TCP,
  through tbf on both veth ends): at 200 Mbit/s a 10 KiB burst gave 187.8 Mbit/s of
  payload, 64-100 KB 191.6-192.3 (the ceiling is 191.3); at 1 Gbit/s 64 KiB gave 825,
  256 KiB 948, 500 KB 980; at 100 Mbit/s 50 KB gave 95.9.
* ``latency``: the longest a packet may wait in the queue, which sets the queue's
  length. It made no difference to bulk throughput from 5 to 100 ms; 20 ms is a
  switch with modest buffers, so a small message queued behind a large transfer
  waits at most that long.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from .rates import format_rate

__all__ = ["TbfParams", "choose_tbf", "TIMER_TICK_S", "MIN_BURST", "QUEUE_LATENCY_MS"]

#: One kernel timer tick at ``CONFIG_HZ=250``, the common distribution setting: the burst covers it.
TIMER_TICK_S = 0.004
#: The smallest burst: a few full-size frames, so even slow links send whole segments back to back.
MIN_BURST = 16 * 2**10
#: How long a packet may queue before tbf drops it.
QUEUE_LATENCY_MS = 20


@dataclass(frozen=True)
class TbfParams:
    """One ``tbf`` qdisc.

    Attributes:
        rate_bps: the rate in bits per second.
        burst_bytes: the bucket's size in bytes.
        latency_ms: the longest a packet may queue, in milliseconds.
    """

    rate_bps: int
    burst_bytes: int
    latency_ms: int

    def tc_args(self) -> List[str]:
        """The qdisc's part of ``tc qdisc add dev X root ...``.

        Returns:
            ``["tbf", "rate", "<n>bit", "burst", "<n>", "latency", "<n>ms"]``.
        """
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                "latency", f"{self.latency_ms}ms"]

    def describe(self) -> str:
        """For the report: ``tbf rate 200 Mbit/s burst 100000 B latency 20 ms``."""
        return f"tbf rate {format_rate(self.rate_bps)} burst {self.burst_bytes} B latency {self.latency_ms} ms"


def choose_tbf(rate_bps: int) -> TbfParams:
    """The tbf settings that give ``rate_bps`` to large transfers (see the module's docstring).

    Args:
        rate_bps: the link rate in bits per second.

    Returns:
        The qdisc's settings.

    Raises:
        ValueError: ``rate_bps`` is not positive.
    """
    if rate_bps <= 0:
        raise ValueError(f"rate_bps={rate_bps!r} must be a positive number of bits per second")
    burst = max(MIN_BURST, int(rate_bps / 8 * TIMER_TICK_S))
    return TbfParams(int(rate_bps), burst, QUEUE_LATENCY_MS)
