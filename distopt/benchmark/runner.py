"""Runs every section of the benchmark and gathers the figures :mod:`.report` prints.

With ``world > 1``: one launch of ``world`` processes times every workload, then
one fresh launch per (workload, memory-probed mode) measures peak memory. The
world-size-1 section compares the wrapper with no process group against the bare
inner optimizer in this process.
"""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..launching import launch
from ..wrapper.optimizer import DEFAULT_PACK_THRESHOLD
from .config import BenchConfig
from .memory import memory_worker
from .modes import memory_mode_names
from .process import worker_setup
from .results import WorkloadResult
from .timing import bench_worker, summarise, workload_raw
from .workloads import WORKLOADS

__all__ = ["run_benchmark"]


def _launch(fn: Callable[..., Any], cfg: BenchConfig, args: Tuple[Any, ...], start_method: Optional[str] = None
            ) -> List[Any]:
    return launch(fn, nprocs=cfg.world, args=args, backend=cfg.backend, start_method=start_method)


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Run every section of the benchmark and return its figures.

    Args:
        cfg: what to run.
        log: receives one line per phase (progress for humans).

    Returns:
        ``{"config", "environment", "distributed": [WorkloadResult], "world1": [WorkloadResult]}``.

    Raises:
        RuntimeError: if the world-size-1 section is to run in a process that has a process group.
    """
    distributed: List[WorkloadResult] = []
    if cfg.world > 1:
        log(f"timing {', '.join(cfg.workloads)} on {cfg.world} processes ({cfg.backend})")
        per_rank = _launch(bench_worker, cfg, (cfg,))
        distributed = [summarise([rank[i] for rank in per_rank], cfg.world) for i in range(len(cfg.workloads))]
        if cfg.memory:
            for result in distributed:
                for mode in memory_mode_names(cfg):
                    if mode in result.modes:
                        log(f"memory probe: {result.name}/{mode} in a fresh launch")
                        # Spawned: a worker forked from the fork server counts the server's pages it
                        # writes to (copy on write) as its own, which would inflate every probe.
                        peaks = _launch(memory_worker, cfg, (cfg, result.name, mode), start_method="spawn")
                        known = [p for p in peaks if p is not None]
                        result.modes[mode].peak_mem_bytes = max(known) if known else None
    world1: List[WorkloadResult] = []
    if cfg.world1 or cfg.world == 1:
        log("world-size-1: wrapper without a process group vs the bare optimizer, in this process")
        world1 = _world1_section(cfg)
    return {
        "config": asdict(cfg),
        "environment": _environment(cfg),
        "distributed": distributed,
        "world1": world1,
    }


def _world1_section(cfg: BenchConfig) -> List[WorkloadResult]:
    if dist.is_initialized():
        raise RuntimeError("the world-size-1 section needs a process without a process group; run it outside torchrun")
    one = replace(cfg, world=1)
    worker_setup(one)
    return [summarise([workload_raw(one, WORKLOADS[name], distributed=False)], 1) for name in cfg.workloads]


def _environment(cfg: BenchConfig) -> Dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_cores": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if cfg.device_type == "cuda" and torch.cuda.is_available() else "cpu",
        "distopt_default_pack_threshold": DEFAULT_PACK_THRESHOLD,
    }
