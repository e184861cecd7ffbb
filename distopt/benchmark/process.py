"""What every benchmark process sets up the same way: threads, device, per-rank batch, seeded replicas.

Shared by the modes, the timing workers and the memory probes, so that each of
them sees identical inputs.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from .config import BenchConfig
from .workloads import Batch, Workload

__all__ = ["worker_setup", "current_device", "sync", "make_batch", "fresh_model"]


def worker_setup(cfg: BenchConfig) -> None:
    """Give this process its share of the cores.

    Args:
        cfg: the run; ``cfg.world`` processes share the cores.
    """
    # Processes share the cores: one process per core is the fair layout for every mode.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // cfg.world))


def current_device() -> torch.device:
    """The device this rank runs on.

    Returns:
        The launcher's CUDA device under an NCCL process group, else the CPU.
    """
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # the launcher picked it
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so a step's time includes it (no-op on CPU).

    Args:
        device: the device to wait for.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(workload: Workload, cfg: BenchConfig, device: torch.device) -> Batch:
    """This rank's fixed batch of ``workload``: the same for every mode, different per rank.

    Args:
        workload: whose ``make_batch`` to call.
        cfg: supplies the seed.
        device: where the batch goes.

    Returns:
        ``(input, target)`` on ``device``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    x, y = workload.make_batch(gen)
    return x.to(device), y.to(device)


def fresh_model(workload: Workload, seed: int, device: torch.device) -> nn.Module:
    """A new replica of ``workload``'s model, initialised from ``seed``.

    Args:
        workload: whose model to build.
        seed: seeds the initialisation.
        device: where the model goes.

    Returns:
        The model on ``device``.
    """
    # Same seed for every mode and rank: identical replicas without a broadcast.
    torch.manual_seed(seed)
    return workload.build_model().to(device)
