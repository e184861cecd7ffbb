"""What ``distopt.horovod`` does not provide, and what to use instead.

Process sets: only :data:`global_process_set` (all ranks) exists; the rest of
Horovod's process-set API raises ``NotImplementedError`` naming torch's
equivalent. Adasum raises likewise (see :mod:`distopt.horovod.reduce_op`). Names
Horovod has and this package does not (``alltoall``, ``SyncBatchNorm``, ...)
raise ``AttributeError`` with the torch equivalent, through the package's
``__getattr__``.
"""
from __future__ import annotations

from typing import Any, NoReturn, Optional, Sequence

__all__ = [
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
]

_PROCESS_SET_ADVICE = (
    "Horovod process sets are not supported by distopt.horovod; every hvd collective spans all ranks. "
    "For a subgroup, create it with torch.distributed.new_group(ranks) and pass it as process_group= "
    "to distopt.DistributedOptimizer or as group= to torch.distributed collectives"
)

_ADASUM_ADVICE = (
    "Adasum is not supported by distopt.horovod; use op=hvd.Average (the default) and scale the "
    "learning rate by hvd.size() (or hvd.local_size() on GPUs) as the Horovod docs do for Average"
)


# ====================================================================== process sets


class ProcessSet:
    """Horovod's process sets are not supported; only :data:`global_process_set` exists.

    Raises:
        NotImplementedError: always, naming torch's equivalent.
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        raise NotImplementedError(_PROCESS_SET_ADVICE)


class _GlobalProcessSet:
    def __repr__(self) -> str:
        return "hvd.global_process_set"


#: All ranks: the only process set, accepted wherever Horovod takes ``process_set=``.
global_process_set = _GlobalProcessSet()


def add_process_set(process_set: Any) -> None:
    """Not supported.

    Raises:
        NotImplementedError: always, naming torch's equivalent.
    """
    raise NotImplementedError(_PROCESS_SET_ADVICE)


def remove_process_set(process_set: Any) -> None:
    """Not supported.

    Raises:
        NotImplementedError: always, naming torch's equivalent.
    """
    raise NotImplementedError(_PROCESS_SET_ADVICE)


def _check_process_set(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(_PROCESS_SET_ADVICE)


# ====================================================================== names Horovod has and distopt does not


_UNSUPPORTED = {
    "alltoall": "use torch.distributed.all_to_all_single",
    "alltoall_async": "use torch.distributed.all_to_all_single(..., async_op=True)",
    "reducescatter": "use torch.distributed.reduce_scatter_tensor",
    "reducescatter_async": "use torch.distributed.reduce_scatter_tensor(..., async_op=True)",
    "grouped_reducescatter": "use torch.distributed.reduce_scatter_tensor per tensor",
    "sparse_allreduce_async": "pass sparse_as_dense=True to hvd.DistributedOptimizer",
    "SyncBatchNorm": "use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
    "elastic": "use torchrun --nnodes MIN:MAX --max-restarts N and resume from a checkpoint",
    "start_timeline": "use torch.profiler",
    "stop_timeline": "use torch.profiler",
    "ddl_built": "distopt runs on torch.distributed (gloo/NCCL)",
    "ccl_built": "distopt runs on torch.distributed (gloo/NCCL)",
}


def _missing_attribute(name: str) -> NoReturn:
    """The package's ``__getattr__``: ``hvd.<name>`` is missing; say what to use if Horovod has ``name``."""
    if name in _UNSUPPORTED:
        raise AttributeError(f"distopt.horovod does not provide hvd.{name}: {_UNSUPPORTED[name]}")
    raise AttributeError(f"module {__package__!r} has no attribute {name!r}")
