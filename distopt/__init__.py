"""distopt: make any PyTorch optimizer data-parallel.

The package is layered, from the ground up (no module imports a higher layer; the
import-linter contract in ``setup.cfg`` keeps it so): :mod:`distopt.planning` (pure
planning), :mod:`distopt.transport` (private groups, waits, the stall inspector),
:mod:`distopt.collectives` and :mod:`distopt.launching`, :mod:`distopt.compression`
(the protocol, and the compressors ``compression=`` names), :mod:`distopt.engine` (the reduction
engine), :mod:`distopt.modes` (the modes: :class:`Synchronous`, :class:`ShardedState`,
:class:`LocalSGD`, :class:`DiLoCo`, :class:`Islands`), :mod:`distopt.fault_tolerance` (torchft, optional),
:mod:`distopt.wrapper` (the public :class:`DistributedOptimizer`), and the fronts
:mod:`distopt.horovod` and :mod:`distopt.benchmark`.
"""
from . import compression, optim
from .collectives import (
    all_gather,
    all_gather_object,
    all_reduce,
    all_reduce_dict,
    all_reduce_params,
    barrier,
    bcast_list_,
    broadcast,
    broadcast_object_list,
    broadcast_parameters,
    collect_results,
    gather,
    gather_object,
    get_dist_info,
    get_local_rank,
    get_offsets,
    get_rank,
    get_world_size,
    is_distributed,
    param_pack_concat,
    param_pack_split,
    sync_random_seed,
    synchronized,
)
from .launching import LaunchError, LaunchTimeoutError, WorkerFailedError, init, launch, launcher, shutdown
from .modes import DiLoCo, Islands, LocalSGD, ShardedState, Synchronous, merge_state_dicts
from .planning.drift import DriftError, DriftReport, DriftWarning
from .planning.stats import StepStats
from .transport.stalls import StallError
from .wrapper import DistributedOptimizer, RankState, join

__all__ = [
    "DistributedOptimizer",
    "StepStats",
    "StallError",
    "DriftError",
    "DriftWarning",
    "DriftReport",
    "join",
    "Synchronous",
    "ShardedState",
    "LocalSGD",
    "DiLoCo",
    "Islands",
    "merge_state_dicts",
    "RankState",
    "optim",
    "compression",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "get_local_rank",
    "get_dist_info",
    "barrier",
    "synchronized",
    "all_reduce",
    "all_gather",
    "gather",
    "broadcast",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "sync_random_seed",
    "collect_results",
    "all_reduce_params",
    "all_reduce_dict",
    "bcast_list_",
    "broadcast_parameters",
    "get_offsets",
    "param_pack_concat",
    "param_pack_split",
    "launch",
    "launcher",
    "init",
    "shutdown",
    "LaunchError",
    "WorkerFailedError",
    "LaunchTimeoutError",
]
