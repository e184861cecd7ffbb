"""What ``distopt.horovod`` does not provide, and what to use instead.

Adasum raises ``NotImplementedError`` naming what to use (see
:mod:`distopt.horovod.reduce_op`). Names Horovod has and this package does not (``alltoall``, ``SyncBatchNorm``, ...)
raise ``AttributeError`` with the torch equivalent, through the package's
``__getattr__``.
"""
from __future__ import annotations

from typing import NoReturn

__all__: list = []  # what it holds is raised, not exported

ADASUM_ADVICE = (
    "Adasum is not supported by distopt.horovod; use op=hvd.Average (the default) and scale the "
    "learning rate by hvd.size() (or hvd.local_size() on GPUs) as the Horovod docs do for Average"
)


# ====================================================================== names Horovod has and distopt does not


_UNSUPPORTED = {
    "SyncBatchNorm": "use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
    "elastic": "use torchrun --nnodes MIN:MAX --max-restarts N and resume from a checkpoint",
    "start_timeline": "use torch.profiler",
    "stop_timeline": "use torch.profiler",
}


def missing_attribute(name: str) -> NoReturn:
    """The package's ``__getattr__``: ``hvd.<name>`` is missing; say what to use if Horovod has ``name``."""
    if name in _UNSUPPORTED:
        raise AttributeError(f"distopt.horovod does not provide hvd.{name}: {_UNSUPPORTED[name]}")
    raise AttributeError(f"module {__package__!r} has no attribute {name!r}")
