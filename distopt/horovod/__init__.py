"""``import distopt.horovod as hvd``: Horovod's PyTorch API on torch.distributed, started by ``torchrun``.

A script written for ``horovod.torch`` runs unchanged except for its import
line, started with ``torchrun --nproc-per-node N script.py`` instead of
``horovodrun -np N python script.py``. The names, defaults and semantics follow
Horovod's PyTorch API; :class:`DistributedOptimizer` is distopt's
:class:`distopt.DistributedOptimizer` (packed all-reduces overlapping backward)
under Horovod's signature.

Where Horovod has sharp edges they are fixed rather than copied:

* :func:`broadcast_optimizer_state` copies the root's state without taking an
  optimizer step, so no rank's parameters or moments move;
* ``zero_grad(set_to_none=...)`` is accepted, and ``zero_grad()`` right after
  ``backward()`` is safe (distopt waits for in-flight reductions);
* misuse raises ``ValueError``/``TypeError``/``RuntimeError`` (never ``AssertionError``),
  and a failed collective Horovod's ``HorovodInternalError`` (a ``RuntimeError``), on every
  rank alike;
* an object the root cannot serialize raises ``TypeError`` on every rank, where Horovod's
  other ranks would wait for it (objects travel by cloudpickle when installed, as Horovod's);
* fp16 compression divides by the number of ranks *before* the 16-bit cast, so
  averaging large gradients does not overflow.

As with Horovod, the ``*_async`` collectives return at once and run on a
background thread (:mod:`distopt.horovod.background`), and a second operation
with the ``name`` of one still in flight raises ``ValueError``. Collectives are
matched by call order (torch.distributed), not by ``name``: every rank must
issue them in the same order.

Process sets are ``torch.distributed`` groups (:mod:`distopt.horovod.process_sets`).
Not provided: Adasum (``NotImplementedError`` saying what to use instead),
``SyncBatchNorm``, ``elastic`` and the timeline
(accessing them raises ``AttributeError`` with the torch equivalent).
"""
# One module per concept; this file only gathers their public names.
from .allgather_ops import (
    allgather,
    allgather_async,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from .allreduce_ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from .basics import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    shutdown,
)
from .broadcast_ops import broadcast, broadcast_, broadcast_async, broadcast_async_
from .compression import BF16Compressor, Compression, Compressor, FP16Compressor, NoneCompressor
from .errors import HorovodInternalError, HostsUpdatedInterrupt
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .reduce_op import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .scatter_ops import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from .background import Handle
from .sync import barrier, join, poll, synchronize
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .session import cross_rank, cross_size, is_initialized, local_rank, local_size, rank, size
from .unsupported import missing_attribute as __getattr__  # Horovod names distopt lacks: say what to use

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    # life cycle and topology
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "ccl_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "cuda_built",
    "rocm_built",
    # reduction ops and compression
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compressor",
    "NoneCompressor",
    "FP16Compressor",
    "BF16Compressor",
    "Compression",
    # process sets (only the global one)
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    # tensor collectives
    "Handle",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "synchronize",
    "poll",
    "join",
    "barrier",
    # objects, models and optimizers
    "broadcast_object",
    "allgather_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "DistributedOptimizer",
]

