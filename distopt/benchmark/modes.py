"""Which modes one run runs, in what order, and how each is built and stepped.

The modes themselves, by name, are :data:`~.mode_specs.MODES`. ``bare_allreduce``
is no training mode: one all-reduce of a flat buffer as large as all gradients
together, the cost of the communication alone. It runs after the training
modes, only with a process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ..wrapper.optimizer import DistributedOptimizer
from .config import BenchConfig
from .mode_specs import MODES, split_mode_name
from .process import fresh_model, sync
from .workloads import Batch, LossFn, Workload

__all__ = [
    "Mode",
    "mode_names",
    "memory_mode_names",
    "build_mode",
    "bare_allreduce_mode",
    "train_step_fn",
]


@dataclass
class Mode:
    """One timed thing: ``run_step`` runs one step; ``stats_source`` is the distopt optimizer, if any.

    ``count_steps`` steps are averaged for the all-reduce figures (local SGD sends every H-th step).
    """

    name: str
    run_step: Callable[[], None]
    stats_source: Optional[DistributedOptimizer] = None
    count_steps: int = 1


def mode_names(cfg: BenchConfig, distributed: bool) -> List[str]:
    """The training modes one workload runs, in run order (``bare_allreduce`` not included).

    Args:
        cfg: its ``thresholds`` add one ``distopt@<bytes>`` mode each.
        distributed: whether a process group exists; without one, ``distributed_only`` modes are left out.

    Returns:
        Mode names for :func:`build_mode`.
    """
    names = [name for name, spec in MODES.items() if (distributed or not spec.distributed_only)
             and (not spec.optional or name in cfg.extra_modes)]
    names += [f"distopt@{t}" for t in cfg.thresholds]
    return names


def memory_mode_names(cfg: Optional[BenchConfig] = None) -> List[str]:
    """The modes whose peak memory is probed, in probe order.

    Args:
        cfg: its ``extra_modes`` add the optional modes asked for (default: none).

    Returns:
        Names from :data:`~.mode_specs.MODES` with ``memory_probe`` set.
    """
    extra = () if cfg is None else cfg.extra_modes
    return [name for name, spec in MODES.items() if spec.memory_probe and (not spec.optional or name in extra)]


def train_step_fn(
    name: str, model: nn.Module, optimizer: Any, batch: Batch, loss_fn: LossFn, device: torch.device
) -> Callable[[], None]:
    """One training step on a fixed batch, with profiler labels ``bench/<name>/...``.

    Args:
        name: labels the profiler ranges.
        model: the module to call (possibly a DDP wrapper).
        optimizer: what to ``step()`` and ``zero_grad(set_to_none=True)``.
        batch: ``(input, target)``.
        loss_fn: ``loss_fn(model(input), target)`` is the loss.
        device: waited for at the end of the step.

    Returns:
        A function that runs one step.
    """
    x, y = batch

    def run_step() -> None:
        with record_function(f"bench/{name}/forward"):
            loss = loss_fn(model(x), y)
        with record_function(f"bench/{name}/backward"):
            loss.backward()
        with record_function(f"bench/{name}/step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(device)

    return run_step


def build_mode(name: str, workload: Workload, cfg: BenchConfig, batch: Batch, device: torch.device) -> Mode:
    """Build the model copy and optimizer of mode ``name`` (``distopt@<bytes>`` picks a threshold).

    Args:
        name: a training mode from :data:`~.mode_specs.MODES`, or ``<name>@<bytes>`` of one with ``variants``.
        workload: the model, batch maker and loss.
        cfg: supplies the seed and learning rate.
        batch: the fixed batch every step trains on.
        device: where the model lives.

    Returns:
        The mode, not yet warmed up.

    Raises:
        ValueError: if ``name`` is no training mode.
    """
    base, sep, _ = name.partition("@")
    spec = MODES.get(base)
    if spec is None or (sep and not spec.variants):
        variants = " or ".join(f"{n}@<bytes>" for n, s in MODES.items() if s.variants)
        raise ValueError(f"mode={name!r} is unknown; use {', '.join(MODES)} or {variants}")
    with record_function(f"bench/{name}/build"):
        model = fresh_model(workload, cfg.seed, device)
        sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        module, optimizer = spec.wrap(model, sgd, device, split_mode_name(name)[1])
        # A mode's adapter around a distopt optimizer holds it as ``opt``.
        inner = getattr(optimizer, "opt", optimizer)
        stats_source = inner if isinstance(inner, DistributedOptimizer) else None
        return Mode(name, train_step_fn(name, module, optimizer, batch, workload.loss_fn, device), stats_source,
                    spec.count_steps)


def bare_allreduce_mode(grad_numel: int, dtype: torch.dtype, device: torch.device) -> Mode:
    """The ``bare_allreduce`` mode: one all-reduce of a flat buffer per step, no compute.

    Args:
        grad_numel: elements of all gradients of one replica together.
        dtype: the gradients' dtype.
        device: where the buffer lives.

    Returns:
        The mode.
    """
    flat = torch.zeros(grad_numel, dtype=dtype, device=device)

    def run_step() -> None:
        with record_function("bench/bare_allreduce"):
            dist.all_reduce(flat)
        sync(device)

    return Mode("bare_allreduce", run_step)
