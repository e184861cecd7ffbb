"""Collective helpers on torch.distributed that also work in a single process.

Every helper takes ``group=None`` (the default process group) and behaves like a
world of one when no process group is initialized: reductions are the identity,
gathers return ``[data]``, broadcasts return their input. Arguments are checked
the same way in one process as in many, so a wrong ``op`` or ``src`` fails on a
laptop too. ``src`` and ``dst`` are ranks *within* ``group``.

Tensor helpers first agree on the tensors' shapes and dtypes across ranks, so a
mismatch raises the same clear error on every rank instead of hanging, and
move tensors the backend cannot use (CPU tensors under NCCL, CUDA tensors under
gloo) to a device it can, moving the result back.

Import the helpers from here; they live in submodules by what they move:

* :mod:`.groups`: the process group, ranks and world sizes, barriers;
* :mod:`.tensors`: one tensor (all_reduce, all_gather, gather, broadcast, a shared seed);
* :mod:`.objects`: picklable objects, and collect_results;
* :mod:`.params`: many tensors at once, coalesced (parameters, buffers, metric dicts);
* :mod:`.optimizer_state`: an optimizer's state.

``get_offsets``, ``param_pack_concat`` and ``param_pack_split`` are
:mod:`distopt.planning.packing`'s, re-exported here.
"""
from __future__ import annotations

from ..planning.packing import get_offsets, param_pack_concat, param_pack_split
from .groups import barrier, get_dist_info, get_local_rank, get_rank, get_world_size, is_distributed, synchronized
from .objects import all_gather_object, broadcast_object_list, collect_results, gather_object
from .optimizer_state import broadcast_optimizer_state
from .params import all_reduce_dict, all_reduce_params, bcast_list_, broadcast_parameters
from .tensors import all_gather, all_reduce, broadcast, gather, sync_random_seed

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
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
    "broadcast_optimizer_state",
    "get_offsets",
    "param_pack_concat",
    "param_pack_split",
]
