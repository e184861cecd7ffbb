"""Peak memory of one mode of one workload, measured in a fresh process per rank.

Peak memory is measured for the modes of :func:`~distopt.benchmark.modes.memory_mode_names`
(``local``, ``ddp`` and ``distopt``) in a fresh launch per (workload, mode): on
CUDA the growth of ``torch.cuda.max_memory_allocated``, on CPU the growth of the
process's peak resident set size (Linux ``VmHWM``, reset just before the mode is
built) from just before the mode is built through its warm-up steps. It therefore
counts parameters, gradients, optimizer state, communication buffers, activations
and allocator slack; the caller reports the largest figure over the ranks.
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .config import BenchConfig
from .modes import build_mode
from .process import current_device, make_batch, worker_setup
from .workloads import WORKLOADS

__all__ = ["memory_worker"]


def _current_rss() -> Optional[int]:
    """Resident set size in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux only); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        # ru_maxrss is KiB on Linux, bytes on macOS.
        scale = 1 if sys.platform == "darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    except ImportError:
        return None


def _warm_process(device: torch.device) -> None:
    """One step of a tiny model and one of each collective, so one-time costs (autograd engine,
    kernel libraries; ~80 MiB of RSS on CPU) land before the baseline and are not charged to
    whichever mode is probed."""
    model = nn.Linear(4, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del model, opt
    if dist.is_initialized():
        # The first call of each kind of collective maps gloo's code for it (1.4-1.8 MiB of shared,
        # file-backed pages): warm the kinds the modes use, so that cost is not charged to whichever
        # mode calls one first.
        one = torch.ones(1, device=device)
        dist.all_reduce(one)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_single(torch.empty(dist.get_world_size(), device=device), one)
        dist.broadcast(one, src=0)
        dist.barrier()
    gc.collect()


def memory_worker(cfg: BenchConfig, workload_name: str, mode_name: str) -> Optional[int]:
    """In a fresh process: peak memory growth from building mode ``mode_name`` through its warm-up.

    Spawned by name, so it stays at module level.

    Args:
        cfg: the run.
        workload_name: a key of :data:`~distopt.benchmark.WORKLOADS`.
        mode_name: a training mode for :func:`~distopt.benchmark.modes.build_mode`.

    Returns:
        The growth in bytes (never negative), or None where memory cannot be read.
    """
    worker_setup(cfg)
    device = current_device()
    workload = WORKLOADS[workload_name]
    batch = make_batch(workload, cfg, device)
    _warm_process(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before: Optional[int] = torch.cuda.memory_allocated(device)
    else:
        _reset_peak_rss()
        before = _current_rss()
    mode = build_mode(mode_name, workload, cfg, batch, device)
    for _ in range(cfg.warmup):
        mode.run_step()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss()
    if dist.is_initialized():
        dist.barrier()
    if before is None or peak is None:
        return None
    return max(0, peak - before)
