"""Opening a :class:`~distopt.engine.GradientEngine` over a process group: its channel, its stall watch.

The wrapper opens one for its gradients; a mode may open more, each over a group of its
own (:meth:`distopt.modes.ModeContext.open_engine`), and owns and closes those.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Tuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import collectives
from ..compression.protocol import Compressor
from ..transport import private_groups, stalls
from ..transport.stalls import Progress
from .engine import GradientEngine
from .state import EngineConfig, World

__all__ = ["open_engine", "open_channel"]


def open_engine(process_group: Optional[ProcessGroup], *, reduce_op: str, pack_threshold: int,
                compressor: Optional[Compressor], sparse_as_dense: bool, backward_passes_per_step: int,
                root_rank: int, stall_warning: Optional[float], stall_timeout: Optional[float],
                world: Optional[World] = None) -> GradientEngine:
    """An engine over a private group of its own with the ranks of ``process_group`` (none in a group of one).

    Every rank of ``process_group``, and only those, must call it, at the same point.

    Args:
        process_group: the ranks to average over (None: the default group).
        reduce_op: ``"mean"`` or ``"sum"``.
        pack_threshold: bytes at which a pack closes.
        compressor: how float packs travel, or None: as they are. Its state is this engine's alone.
        sparse_as_dense: densify sparse gradients instead of raising.
        backward_passes_per_step: passes accumulated before the reducing one.
        root_rank: the rank, in ``process_group``, whose observed gradient order becomes the plan.
        stall_warning: seconds before a wait warns, or None.
        stall_timeout: seconds before a wait raises, or None.
        world: the engine's :class:`World`, if the caller shares it (default: a new one of the group's size).

    Raises:
        StallError: the other ranks did not open theirs within the timeout.
    """
    world_size = collectives.get_world_size(process_group)
    world = world if world is not None else World(world_size)
    mean = reduce_op == "mean"
    # NCCL averages natively. Otherwise the mean's 1/world is applied while each gradient is
    # copied into its pack (no extra pass), and always before a 16-bit cast, which could overflow.
    native_avg = world_size > 1 and dist.get_backend(process_group) == "nccl"
    scale_mean = mean and (compressor is not None or not native_avg)
    channel = progress = None
    if world_size > 1:
        channel, progress = open_channel(process_group, stall_warning, stall_timeout)
    config = EngineConfig(op=dist.ReduceOp.AVG if mean and not scale_mean else dist.ReduceOp.SUM,
                          pack_threshold=pack_threshold, mean=mean, scale_mean=scale_mean, compressor=compressor,
                          sparse_as_dense=sparse_as_dense, root_rank=root_rank)
    return GradientEngine(channel=channel, config=config, world=world,
                          backward_passes_per_step=backward_passes_per_step, progress=progress)


def open_channel(process_group: Optional[ProcessGroup], stall_warning: Optional[float],
                 stall_timeout: Optional[float]) -> Tuple[private_groups.PrivateGroup, Progress]:
    """Create the private group (the *channel*) and have the stall inspector watch it.

    The engine's own traffic travels on it, so it never pairs with the user's
    collectives. Its timeout is the stall timeout, so that blocking collectives (the
    construction check, broadcasts, the plan) honour it too.

    Raises:
        StallError: the other ranks did not create theirs within the timeout.
    """
    limit = None if stall_timeout is None else timedelta(seconds=stall_timeout)
    try:
        channel = private_groups.create(process_group, limit)
    except RuntimeError as exc:  # torch's wording ("wait timeout after 1500ms, keys: /0//1//cpu//0/1") names no rank
        if not any(word in str(exc).lower() for word in ("timeout", "timed out")):
            raise
        seconds = (limit or private_groups.timeout_of(process_group) or timedelta(0)).total_seconds()
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
