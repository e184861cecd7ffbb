"""The modes the benchmark compares, by name: what each wraps, where it runs, how it is named.

A training mode gets a fresh replica of the workload's model (same seed in every
mode and rank) and ``SGD(momentum=0.9)`` over it; its :class:`ModeSpec` wraps the
two into what the timed step calls. Adding a mode is one entry in :data:`MODES`.
A spec with ``variants`` also runs as ``<name>@<bytes>``: ``--thresholds`` adds
one ``distopt@<bytes>`` mode per distopt pack threshold.

This module knows nothing of a run's configuration, so :mod:`.config` can check
mode names against it; :mod:`.modes` picks and builds the modes of a run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..modes.sharded import ShardedState
from ..wrapper.optimizer import DistributedOptimizer
from .sizes import format_size

__all__ = [
    "Wrap",
    "ModeSpec",
    "MODES",
    "optional_mode_names",
    "split_mode_name",
    "display_name",
    "wrap_ddp",
]

#: ``(model, sgd, device, variant) -> (module the step calls, optimizer the step steps)``;
#: ``variant`` is the ``<bytes>`` of a ``<name>@<bytes>`` mode, else None.
Wrap = Callable[[nn.Module, torch.optim.Optimizer, torch.device, Optional[int]], Tuple[nn.Module, Any]]


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
    opt._engine.enter_join(divide_by_world=False)
    return model, opt


def _distopt_sharded(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                     variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, shard_state=True)


def _distopt_sharded_background(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                                variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, mode=ShardedState(share="background"))


def _distopt_sharded_gradients(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                               variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, shard_state="gradients")


def _distopt_sharded_gradients_background(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                                          variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, mode=ShardedState(share="background", gradients=True))


def _zero(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
          variant: Optional[int]) -> Tuple[nn.Module, Any]:
    """torch's ZeroRedundancyOptimizer (the SGD's class and settings) under DDP: ZeRO-1 as torch ships it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(sgd), **sgd.defaults)
    return wrap_ddp(model, device), zero


def _distopt_uninspected(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                         variant: Optional[int]) -> Tuple[nn.Module, Any]:
    # Without its position the wrapper waits plainly and records nothing per collective. The
    # inspector's thread stays: it serves every wrapper of the process, so it costs all modes alike.
    opt = DistributedOptimizer(sgd)
    opt._engine.stop_inspection()
    return model, opt


def _distopt_allreduce(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                       variant: Optional[int]) -> Tuple[nn.Module, Any]:
    opt = DistributedOptimizer(sgd)
    opt._engine.reconfigure(gather_sum_limit=-1)  # every sum an all-reduce, however small
    return model, opt


def _distopt_local4(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                    variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, sync_every=4)


def _distopt_stream4(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                     variant: Optional[int]) -> Tuple[nn.Module, Any]:
    # Streaming local SGD at the same period: a quarter of the model synced at every step, each
    # sync travelling during the next step.
    return model, DistributedOptimizer(sgd, sync_every=4, sync_fragments=4, sync_overlap=1)


def _distopt_nodrift(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                     variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, check_every=0)


def _distopt_drift1(model: nn.Module, sgd: torch.optim.Optimizer, device: torch.device,
                    variant: Optional[int]) -> Tuple[nn.Module, Any]:
    return model, DistributedOptimizer(sgd, check_every=1)


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
    # The same, the parameter share overlapping the next forward (ShardedState(share="background")).
    "distopt+shard-background": ModeSpec(_distopt_sharded_background, distributed_only=True, optional=True),
    # distopt with shard_state="gradients": the gradients reduce-scattered to their owners too (ZeRO-2).
    "distopt+shard-gradients": ModeSpec(_distopt_sharded_gradients, distributed_only=True, optional=True),
    # The same, the parameter share overlapping the next forward.
    "distopt+shard-gradients-background": ModeSpec(_distopt_sharded_gradients_background, distributed_only=True,
                                                   optional=True),
    # torch.distributed.optim.ZeroRedundancyOptimizer under DDP.
    "zero": ModeSpec(_zero, distributed_only=True, optional=True),
    # distopt with the stall inspector off: what the inspector costs.
    "distopt-noinspect": ModeSpec(_distopt_uninspected, distributed_only=True, memory_probe=False, optional=True),
    # distopt with every sum an all-reduce: what gathering small sums saves.
    "distopt-allreduce": ModeSpec(_distopt_allreduce, distributed_only=True, memory_probe=False, optional=True),
    # local SGD: gradients stay local, parameters are averaged every 4th step (sync_every=4).
    "distopt-local4": ModeSpec(_distopt_local4, distributed_only=True, memory_probe=False, optional=True,
                               count_steps=4),
    # streaming local SGD at the same period: one fragment of four per step, each overlapped with the next step.
    "distopt-stream4": ModeSpec(_distopt_stream4, distributed_only=True, memory_probe=False, optional=True,
                                count_steps=4),
    # The drift check: distopt checks every DEFAULT_CHECK_EVERY steps by default, which a median over a few
    # dozen steps cannot see; these two time it off (check_every=0) and at every step (check_every=1), and
    # the report divides their difference, the cost of one check, by the default period.
    "distopt-nodrift": ModeSpec(_distopt_nodrift, distributed_only=True, memory_probe=False, optional=True),
    "distopt+drift1": ModeSpec(_distopt_drift1, distributed_only=True, memory_probe=False, optional=True),
}


def optional_mode_names() -> List[str]:
    """The modes that run only when asked for (:attr:`BenchConfig.extra_modes <.config.BenchConfig>`), sorted.

    Returns:
        Names from :data:`MODES` with ``optional`` set.
    """
    return sorted(name for name, spec in MODES.items() if spec.optional)


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
