"""Timing the link a group's ranks share, for ``pack_threshold="auto"``."""
from __future__ import annotations

import time
from typing import List

import torch
import torch.distributed as dist

from ..planning.pack_size import LinkTiming, fit_link

__all__ = ["measure_link"]

_SMALL = 1 << 10
_LARGE = 1 << 20


def measure_link(group: dist.ProcessGroup, device: torch.device, repeats: int = 7) -> LinkTiming:
    """Time all-reduces of 1 KiB and 1 MiB over ``group`` (every rank calls it, alike) and fit the link.

    The two sizes take turns, so that a passing slowdown (another job's burst, a page fault)
    lands on both rather than on one size's every timing; the fit takes each size's median.
    Each rank gets its own timing; the caller makes one rank's the decision.
    """
    tensors = [torch.zeros(nbytes // 4, dtype=torch.float32, device=device) for nbytes in (_SMALL, _LARGE)]
    for tensor in tensors:
        dist.all_reduce(tensor, group=group)  # the first of a size sets up buffers: not timed
    timings: List[List[float]] = [[], []]
    for _ in range(repeats):
        for seconds, tensor in zip(timings, tensors):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    return fit_link(_SMALL, timings[0], _LARGE, timings[1])
