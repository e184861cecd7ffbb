"""Step times and all-reduce counts of every mode of a workload, per rank, and their merge over ranks.

Every mode is built, warmed up, then timed in interleaved rounds: each round runs
a few steps of every mode in turn, in a rotated order, so that machine noise hits
all modes alike. A step's time is the slowest rank's; the summary gives the
median and quartiles over all timed steps.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import BenchConfig
from .mode_specs import wrap_ddp
from .modes import Mode, bare_allreduce_mode, build_mode, mode_names, train_step_fn
from .process import current_device, fresh_model, make_batch, worker_setup
from .results import ModeResult, WorkloadResult
from .workloads import WORKLOADS, Batch, Workload

__all__ = ["bench_worker", "workload_raw", "summarise"]


def _counting_allreduce_hook(counter: List[int]) -> Callable[..., Any]:
    """A DDP comm hook that counts buckets, then does exactly DDP's default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # Left unannotated: DDP checks the hook's annotations at runtime, and this
    # module's postponed (string) annotations would fail that check.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        counter[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def _count_ddp_allreduces(workload: Workload, cfg: BenchConfig, batch: Batch, device: torch.device) -> int:
    """All-reduce calls per DDP step, on a throwaway replica so the timed one keeps DDP's built-in path."""
    model = fresh_model(workload, cfg.seed, device)
    ddp = wrap_ddp(model, device)
    counter = [0]
    ddp.register_comm_hook(None, _counting_allreduce_hook(counter))
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    step = train_step_fn("ddp_count", ddp, sgd, batch, workload.loss_fn, device)
    for _ in range(max(2, cfg.warmup)):  # past DDP's bucket rebuild
        step()
    counter[0] = 0
    step()
    return counter[0]


def _distopt_counts(mode: Mode) -> Tuple[float, float]:
    """``(collective calls, bytes on the wire)`` per step: the last step's, or the mean over ``count_steps`` more.

    The calls are all-reduces and the all-gathers of gradients that travel as rows.
    """
    opt = mode.stats_source
    assert opt is not None  # only called for distopt modes
    if mode.count_steps == 1:
        return opt.stats.all_reduces + opt.stats.gathers, opt.stats.bytes
    calls = nbytes = 0
    for _ in range(mode.count_steps):  # one whole period, wherever the warm-up left it
        mode.run_step()
        calls, nbytes = calls + opt.stats.all_reduces + opt.stats.gathers, nbytes + opt.stats.bytes
    return calls / mode.count_steps, nbytes / mode.count_steps


def _time_interleaved(modes: Sequence[Mode], steps: int, rounds: int, distributed: bool) -> Dict[str, List[float]]:
    """Seconds of every timed step per mode; each round runs ``steps`` of each mode, order rotated."""
    times: Dict[str, List[float]] = {m.name: [] for m in modes}
    for r in range(rounds):
        shift = r % len(modes)
        for mode in list(modes[shift:]) + list(modes[:shift]):
            if distributed:
                dist.barrier()  # every rank starts the mode together
            for _ in range(steps):
                start = time.perf_counter()
                mode.run_step()
                times[mode.name].append(time.perf_counter() - start)
    return times


def _param_count(workload: Workload) -> int:
    with torch.device("meta"):
        return sum(1 for p in workload.build_model().parameters() if p.requires_grad)


def workload_raw(cfg: BenchConfig, workload: Workload, distributed: bool) -> Dict[str, Any]:
    """Build, warm up and time every mode of one workload in this process; rank-local figures.

    Args:
        cfg: the run.
        workload: what to time.
        distributed: whether this process is one rank of a process group; with one,
            ``ddp`` and ``bare_allreduce`` run too and every mode starts at a barrier.

    Returns:
        ``{"name", "num_params", "grad_bytes", "counts", "times"}``: ``counts`` maps a mode
        to ``(all-reduce calls, bytes)`` per step, ``times`` to the seconds of each timed step.
    """
    device = current_device()
    batch = make_batch(workload, cfg, device)
    probe = fresh_model(workload, cfg.seed, device)
    params = [p for p in probe.parameters() if p.requires_grad]
    grad_numel = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    dtype = params[0].dtype
    del probe, params

    counts: Dict[str, Tuple[Optional[float], Optional[float]]] = {"local": (0, 0)}
    if distributed:
        counts["ddp"] = (_count_ddp_allreduces(workload, cfg, batch, device), grad_bytes)
        counts["bare_allreduce"] = (1, grad_bytes)
        gc.collect()

    modes = [build_mode(name, workload, cfg, batch, device) for name in mode_names(cfg, distributed)]
    if distributed:
        modes.append(bare_allreduce_mode(grad_numel, dtype, device))
    for mode in modes:
        for _ in range(cfg.warmup):
            mode.run_step()
        if mode.stats_source is not None:
            counts[mode.name] = _distopt_counts(mode)

    steps = max(1, math.ceil(cfg.iters * workload.iters_scale / cfg.rounds))
    if distributed:
        times = _time_interleaved(modes, steps, cfg.rounds, distributed)
    else:
        # In one process the wrapper installs nothing, so the difference to resolve is a few
        # microseconds: alternate single steps, and take three times as many, to keep drift out.
        times = _time_interleaved(modes, 1, 3 * steps * cfg.rounds, distributed)
    del modes
    gc.collect()
    return {
        "name": workload.name,
        "num_params": _param_count(workload),
        "grad_bytes": grad_bytes,
        "counts": counts,
        "times": times,
    }


def bench_worker(cfg: BenchConfig) -> List[Dict[str, Any]]:
    """Entry point of every rank: all workloads, one after another.

    Spawned by name, so it stays at module level.

    Args:
        cfg: the run.

    Returns:
        :func:`workload_raw`'s figures per workload of ``cfg.workloads``, in order.
    """
    worker_setup(cfg)
    return [workload_raw(cfg, WORKLOADS[name], distributed=True) for name in cfg.workloads]


def summarise(raw_by_rank: Sequence[Dict[str, Any]], world: int) -> WorkloadResult:
    """Merge ranks: a step takes as long as its slowest rank; then percentiles per mode.

    Args:
        raw_by_rank: :func:`workload_raw`'s figures of one workload, one per rank.
        world: the number of ranks, recorded in the result.

    Returns:
        The workload's result, modes in run order, step times in milliseconds.
    """
    first = raw_by_rank[0]
    modes: Dict[str, ModeResult] = {}
    for name, times0 in first["times"].items():
        per_step = [max(raw["times"][name][i] for raw in raw_by_rank) * 1e3 for i in range(len(times0))]
        q = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [per_step[0]] * 3
        calls, nbytes = first["counts"].get(name, (None, None))
        modes[name] = ModeResult(name, statistics.median(per_step), q[0], q[2], calls, nbytes, None, per_step)
    workload = WORKLOADS[first["name"]]
    return WorkloadResult(first["name"], workload.description, world, first["num_params"], first["grad_bytes"], modes)
