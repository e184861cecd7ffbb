"""The modes the benchmark compares, which of them run, in what order, and how each is built.

A training mode gets a fresh replica of the workload's model (same seed in every
mode and rank) and ``SGD(momentum=0.9)`` over it; its :class:`ModeSpec` wraps the
two into what the timed step calls. Adding a mode is one entry in :data:`MODES`.
A spec with ``variants`` also runs as ``<name>@<bytes>``: ``--thresholds`` adds
one ``distopt@<bytes>`` mode per distopt pack threshold.

``bare_allreduce`` is no training mode: one all-reduce of a flat buffer as large
as all gradients together, the cost of the communication alone. It runs after
the training modes, only with a process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ..transport import stalls
from ..wrapper.optimizer import DistributedOptimizer
from .config import BenchConfig
from .process import fresh_model, sync
from .sizes import format_size
from .workloads import Batch, LossFn, Workload

__all__ = [
    "Mode",
    "Wrap",
    "ModeSpec",
    "MODES",
    "mode_names",
    "memory_mode_names",
    "split_mode_name",
    "display_name",
    "build_mode",
    "bare_allreduce_mode",
    "train_step_fn",
    "wrap_ddp",
]

#: ``(model, sgd, device, variant) -> (module the step calls, optimizer the step steps)``;
#: ``variant`` is the ``<bytes>`` of a ``<name>@<bytes>`` mode, else None.
Wrap = Callable[[nn.Module, torch.optim.Optimizer, torch.device, Optional[int]], Tuple[nn.Module, Any]]


@dataclass
class Mode:
    """One timed thing: ``run_step`` runs one step; ``stats_source`` is the distopt optimizer, if any.

    ``count_steps`` steps are averaged for the all-reduce figures (local SGD sends every H-th step).
    """

    name: str
    run_step: Callable[[], None]
    stats_source: Optional[DistributedOptimizer] = None
    count_steps: int = 1


@dataclass(frozen=True)
class ModeSpec:
    """How one training mode is built, and where it runs.

    Attributes:
        wrap: turns the fresh replica and its SGD into what the timed step calls.
        distributed_only: needs a process group, so the world-size-1 section leaves it out.
        memory_probe: gets a peak-memory probe (one fresh launch per workload).
        variants: also runs as ``<name>@<bytes>``.
        optional: runs only when asked for (``--modes``), not by default.
        count_steps: steps over which its all-reduce calls and bytes are averaged, for a
            mode whose traffic varies from step to step (local SGD: its sync period).
    """

    wrap: Wrap
    distributed_only: bool = False
    memory_probe: bool = True
    variants: bool = False
    optional: bool = False
    count_steps: int = 1


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    """``model`` in ``DistributedDataParallel`` with its defaults, on ``device``.

    Args:
        model: the replica, already on ``device``.
        device: a CUDA device becomes DDP's only ``device_ids`` entry.

    Returns:
        The wrapped model.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def _local(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
           variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, sgd


def _ddp(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
         variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return wrap_ddp(model, device), sgd


def _distopt(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
             variant: Optional[int]) -> Tuple[nn.Module, Any]:
    kwargs = {} if variant is None else {"pack_threshold": variant}
    return model, DistributedOptimizer(sgd, **kwargs)


def _distopt_join(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                  variant: Optional[int]) -> Tuple[nn.Module, Any]:
    opt = DistributedOptimizer(sgd)
    # What `with opt.join():` sets for the steps inside it while no rank has joined; the block
    # itself cannot stay open across the benchmark's interleaved modes.
    opt._engine.in_join = True
    return model, opt


def _distopt_sharded(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                     variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, shard_state=True)


def _distopt_uninspected(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                         variant: Optional[int]) -> Tuple[nn.Module, Any]:
    # Without its position the wrapper waits plainly and records nothing per collective. The
    # inspector's thread stays: it serves every wrapper of the process, so it costs all modes alike.
    opt = DistributedOptimizer(sgd)
    stalls.retire(opt._engine.progress)
    opt._engine.progress = None
    return model, opt


def _distopt_allreduce(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                       variant: Optional[int]) -> Tuple[nn.Module, Any]:
    opt = DistributedOptimizer(sgd)
    opt._engine.gather_sum_limit = -1  # every sum an all-reduce, however small
    return model, opt


def _distopt_local4(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                    variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, sync_every=4)


#: Training modes by name, in run order.
MODES: Dict[str, ModeSpec] = {
    # The bare inner optimizer, no communication. The floor.
    "local": ModeSpec(_local),
    # torch.nn.parallel.DistributedDataParallel with its defaults.
    "ddp": ModeSpec(_ddp, distributed_only=True),
    # distopt.DistributedOptimizer with its defaults; distopt@<bytes> sets pack_threshold.
    "distopt": ModeSpec(_distopt, variants=True),
    # distopt inside a join block (no rank has joined): the cost of join() while ranks are even.
    "distopt+join": ModeSpec(_distopt_join, distributed_only=True, memory_probe=False, optional=True),
    # distopt with shard_state=True: each rank keeps the momentum of the parameters it owns.
    "distopt+shard": ModeSpec(_distopt_sharded, distributed_only=True, optional=True),
    # distopt with the stall inspector off: what the inspector costs.
    "distopt-noinspect": ModeSpec(_distopt_uninspected, distributed_only=True, memory_probe=False, optional=True),
    # distopt with every sum an all-reduce: what gathering small sums saves.
    "distopt-allreduce": ModeSpec(_distopt_allreduce, distributed_only=True, memory_probe=False, optional=True),
    # local SGD: gradients stay local, parameters are averaged every 4th step (sync_every=4).
    "distopt-local4": ModeSpec(_distopt_local4, distributed_only=True, memory_probe=False, optional=True,
                               count_steps=4),
}


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
        Names from :data:`MODES` with ``memory_probe`` set.
    """
    extra = () if cfg is None else cfg.extra_modes
    return [name for name, spec in MODES.items() if spec.memory_probe and (not spec.optional or name in extra)]


def split_mode_name(name: str) -> Tuple[str, Optional[int]]:
    """``"distopt@65536" -> ("distopt", 65536)``; ``"ddp" -> ("ddp", None)``.

    Args:
        name: a mode name.

    Returns:
        The base name and the variant's byte count (None without ``@``).

    Raises:
        ValueError: if the part after ``@`` is not an integer.
    """
    base, sep, variant = name.partition("@")
    return base, int(variant) if sep else None


def display_name(name: str) -> str:
    """A mode's name for people: ``"distopt@65536" -> "distopt@64KiB"``; others unchanged.

    Args:
        name: a mode name.

    Returns:
        The name with a variant's byte count as :func:`format_size` writes it.
    """
    base, sep, variant = name.partition("@")
    spec = MODES.get(base)
    if sep and spec is not None and spec.variants:
        return f"{base}@{format_size(int(variant))}"
    return name


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
        name: a training mode from :data:`MODES`, or ``<name>@<bytes>`` of one with ``variants``.
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
        stats_source = optimizer if isinstance(optimizer, DistributedOptimizer) else None
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
