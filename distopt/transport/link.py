"""Timing the link a group's ranks share, for ``pack_threshold="auto"``."""
from __future__ import annotations

import time
from typing import List

import torch
import torch.distributed as dist

from ..planning.link import LinkTiming, fit_link

__all__ = ["measure_link"]

_SMALL = 1 << 10
_LARGE = 1 << 20


def measure_link(group: dist.ProcessGroup, device: torch.device, repeats: int = 5) -> LinkTiming:
    """Time all-reduces of 1 KiB and 1 MiB over ``group`` (every rank calls it, alike) and fit the link.

    Each rank gets its own timing; the caller makes one rank's the decision.
    """
    timings: List[List[float]] = []
    for nbytes in (_SMALL, _LARGE):
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor, group=group)  # the first of a size sets up buffers: not timed
        seconds = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        timings.append(seconds)
    return fit_link(_SMALL, timings[0], _LARGE, timings[1])
