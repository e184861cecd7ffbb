"""Building what a :class:`distopt.DistributedOptimizer` runs on: its channel, engine and mode.

The wrapper's own traffic travels on a private group (the *channel*), so it
never pairs with the user's collectives. The channel's timeout is the stall
timeout, so that blocking collectives (the construction check, broadcasts, the
plan) honour it too, and the stall inspector watches this rank's position on it.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import private_groups, stalls
from .engine import GradientEngine
from .modes import LocalSGDMode, Mode, ShardedMode, SynchronousMode
from .modes.local_sgd import OuterFactory
from .stalls import Progress

__all__ = ["open_channel", "build_engine", "choose_mode"]


def open_channel(parent: Optional[ProcessGroup], stall_warning: Optional[float],
                 stall_timeout: Optional[float]) -> Tuple[private_groups.PrivateGroup, Progress]:
    """Create the private group over ``parent`` and have the stall inspector watch it.

    Raises:
        StallError: the other ranks did not create theirs within the timeout.
    """
    limit = None if stall_timeout is None else timedelta(seconds=stall_timeout)
    try:
        channel = private_groups.create(parent, limit)
    except RuntimeError as exc:  # torch's wording ("wait timeout after 1500ms, keys: /0//1//cpu//0/1") names no rank
        if not any(word in str(exc).lower() for word in ("timeout", "timed out")):
            raise
        seconds = (limit or private_groups.timeout_of(parent) or timedelta(0)).total_seconds()
        raise stalls.StallError(
            f"rank {dist.get_rank()} waited more than {seconds:g} s for the other ranks to build their "
            "DistributedOptimizer: every rank must build it, at the same point of the script (is a rank stuck, "
            "or did it fail before reaching it?)"
        ) from exc
    timeout = private_groups.timeout_of(channel.group)
    progress = Progress(channel.group.group_name, dist.get_process_group_ranks(channel.group), dist.get_rank(),
                        stall_warning, stall_timeout, None if timeout is None else timeout.total_seconds())
    stalls.watch(progress)
    return channel, progress


def build_engine(process_group: Optional[ProcessGroup], world_size: int, *, mean: bool,
                 wire_dtype: Optional[torch.dtype], pack_threshold: int, sparse_as_dense: bool,
                 backward_passes_per_step: int, root_rank: int, stall_warning: Optional[float],
                 stall_timeout: Optional[float]) -> GradientEngine:
    """The gradient engine for a wrapper over ``process_group`` (no channel in a group of one)."""
    # NCCL averages natively. Otherwise the mean's 1/world is applied while each gradient is
    # copied into its pack (no extra pass), and always before a 16-bit cast, which could overflow.
    native_avg = world_size > 1 and dist.get_backend(process_group) == "nccl"
    scale = 1.0 / world_size if mean and (wire_dtype is not None or not native_avg) else None
    channel = progress = None
    if world_size > 1:
        channel, progress = open_channel(process_group, stall_warning, stall_timeout)
    return GradientEngine(
        channel=channel,
        scale=scale,
        op=dist.ReduceOp.AVG if mean and scale is None else dist.ReduceOp.SUM,
        pack_threshold=pack_threshold,
        wire_dtype=wire_dtype,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        root_rank=root_rank,
        world_size=world_size,
        mean=mean,
        progress=progress,
    )


def choose_mode(*, local: bool, shard_state: bool, rank: int, world_size: int, sync_every: int,
                outer_optimizer: Optional[OuterFactory], local_warmup: int) -> Mode:
    """The mode the (checked) arguments ask for."""
    if local:
        return LocalSGDMode(sync_every, outer_optimizer, local_warmup)
    if shard_state and world_size > 1:
        return ShardedMode(rank, world_size)
    return SynchronousMode()
