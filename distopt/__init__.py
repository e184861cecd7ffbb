"""distopt: make any PyTorch optimizer data-parallel."""
from . import optim
from .collectives import get_rank, get_world_size, is_distributed
from .launcher import LaunchError, LaunchTimeoutError, WorkerFailedError, init, launch, launcher, shutdown
from .optimizer import DistributedOptimizer, StepStats

__all__ = [
    "DistributedOptimizer",
    "StepStats",
    "optim",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "launch",
    "launcher",
    "init",
    "shutdown",
    "LaunchError",
    "WorkerFailedError",
    "LaunchTimeoutError",
]
