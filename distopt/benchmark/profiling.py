"""``--profile WORKLOAD``: where each mode's step time goes, from ``torch.profiler``.

Every rank builds ``local``, ``ddp`` and ``distopt`` for one workload, warms them
up, then profiles ``--iters`` steps of each (interleaved in rounds, like the
timing). Rank 0 reports, per mode, the mean milliseconds per step of the
benchmark's phase labels (``bench/<mode>/forward``, ``.../backward``,
``.../step``) and of distopt's own labels (``distopt.all_reduce`` launches,
``distopt.wait``), then the operators with the most self CPU time, so the
difference between ``distopt`` and ``local`` can be read off by phase.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from .config import BenchConfig
from .modes import build_mode
from .process import current_device, make_batch, worker_setup
from .workloads import WORKLOADS

__all__ = ["profile_worker", "format_profile"]

_MODES = ("local", "ddp", "distopt")
_TOP = 8


def profile_worker(cfg: BenchConfig, workload_name: str) -> Dict[str, Any]:
    """Profile one workload's modes on this rank; rank 0's figures are the report.

    Args:
        cfg: the run (``iters``, ``rounds``, ``warmup``, ``seed``).
        workload_name: a key of :data:`WORKLOADS`.

    Returns:
        ``{mode: {"phases": {label: ms per step}, "top": [(op, ms per step)]}}``.
    """
    worker_setup(cfg)
    workload = WORKLOADS[workload_name]
    device = current_device()
    batch = make_batch(workload, cfg, device)
    modes = [build_mode(name, workload, cfg, batch, device) for name in _MODES]
    for mode in modes:
        for _ in range(cfg.warmup):
            mode.run_step()
    steps = max(1, cfg.iters // cfg.rounds)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    report: Dict[str, Any] = {}
    for mode in modes:
        with profile(activities=activities) as prof:
            for _ in range(cfg.rounds):
                dist.barrier()
                for _ in range(steps):
                    mode.run_step()
        report[mode.name] = _summary(prof, mode.name, steps * cfg.rounds)
    return report


def _summary(prof: Any, name: str, steps: int) -> Dict[str, Any]:
    phases: Dict[str, float] = {}
    ops: List[Tuple[str, float]] = []
    for event in prof.key_averages():
        key = event.key
        if key.startswith(f"bench/{name}/") or key.startswith("distopt."):
            phases[key.replace(f"bench/{name}/", "")] = event.cpu_time_total / 1e3 / steps
        elif not key.startswith(("bench/", "ProfilerStep")):
            ops.append((key, event.self_cpu_time_total / 1e3 / steps))
    ops.sort(key=lambda kv: -kv[1])
    return {"phases": phases, "top": ops[:_TOP]}


def format_profile(workload_name: str, report: Dict[str, Any]) -> str:
    """Rank 0's profile as text: phases per mode side by side, then each mode's top operators."""
    labels = sorted({label for mode in report.values() for label in mode["phases"]},
                    key=lambda k: (k.startswith("distopt."), k))
    lines = [f"[{workload_name}] ms per step by phase (rank 0, torch.profiler; phases nest: distopt.* run "
             "inside backward and step)"]
    lines.append("  " + "phase".ljust(22) + "".join(m.rjust(12) for m in report))
    for label in labels:
        cells = "".join(f"{report[m]['phases'].get(label, 0.0):12.2f}" for m in report)
        lines.append("  " + label.ljust(22) + cells)
    for mode, figures in report.items():
        lines.append(f"  top self-CPU operators, {mode}: " + ", ".join(f"{op} {ms:.2f}" for op, ms in figures["top"]))
    return "\n".join(lines)
