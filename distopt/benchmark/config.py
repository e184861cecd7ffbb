"""What one benchmark run does: :class:`BenchConfig`, checked when it is made."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .mode_specs import optional_mode_names
from .workloads import WORKLOADS

__all__ = ["BenchConfig"]


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run does.

    Attributes:
        workloads: names from :data:`WORKLOADS`, in run order.
        world: number of processes; 1 runs only the world-size-1 section.
        backend: torch.distributed backend; ``nccl`` runs on CUDA, others on CPU.
        iters: timed steps per mode (times each workload's ``iters_scale``), rounded
            up to a multiple of ``rounds``.
        rounds: interleaving rounds the timed steps are spread over.
        warmup: untimed steps per mode after it is built.
        thresholds: extra distopt pack thresholds in bytes, one mode each.
        extra_modes: optional modes to run too (``distopt+join``, ``distopt-noinspect``, ``distopt-local4``,
            ``distopt-stream4``, ``distopt-nodrift``, ``distopt+drift1``, ...).
        memory: whether to probe peak memory (one fresh launch per mode).
        world1: whether to run the world-size-1 section.
        seed: seeds model initialisation and data.
        lr: SGD learning rate.

    Raises:
        ValueError: if a workload is unknown, ``world``, ``iters``, ``rounds`` or
            ``warmup`` is below 1, a threshold is negative or an extra mode unknown.
    """

    workloads: Tuple[str, ...] = tuple(WORKLOADS)
    world: int = 2
    backend: str = "gloo"
    iters: int = 20
    rounds: int = 10
    warmup: int = 3
    thresholds: Tuple[int, ...] = ()
    extra_modes: Tuple[str, ...] = ()
    memory: bool = True
    world1: bool = True
    seed: int = 0
    lr: float = 1e-4

    def __post_init__(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown:
            raise ValueError(f"workloads={unknown!r} are unknown; choose from {sorted(WORKLOADS)}")
        for name in ("world", "iters", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be at least 1")
        if self.warmup < 1:
            # DDP rebuilds its buckets after the first step; that step must not be timed.
            raise ValueError(f"warmup={self.warmup!r} must be at least 1")
        optional = optional_mode_names()
        unknown = [m for m in self.extra_modes if m not in optional]
        if unknown:
            raise ValueError(f"extra modes {unknown!r} are unknown; choose from {optional}")
        bad = [t for t in self.thresholds if t < 0]
        if bad:
            raise ValueError(f"thresholds={bad!r} must be non-negative byte counts")

    @property
    def device_type(self) -> str:
        """``"cuda"`` for NCCL, else ``"cpu"``."""
        return "cuda" if self.backend == "nccl" else "cpu"
