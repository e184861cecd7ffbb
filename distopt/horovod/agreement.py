"""Before each collective every rank announces what it is about to send: one small all-gather.

torch.distributed matches collectives by call order and trusts the tensors to
fit: a shape, dtype, device or root that differs between ranks hangs or
corrupts. Horovod's coordinator checks them, and lets a rank that called
``hvd.join()`` stand in for the others' collectives. Here each ``hvd`` tensor
collective first gathers a fixed-size announcement from every rank (its state,
the kind of collective, the size and dtype on the wire, and a digest of the full
description), which serves both:

* **agreement**: when the active ranks' digests differ, every rank gathers the
  descriptions and raises the same ``RuntimeError``, naming the ranks and what
  differs;
* **join**: a joined rank answers every announcement with "joined" and takes
  part in the collective announced: zeros in a sum (so Average divides by the
  whole job, as Horovod's does). Any other collective with a joined rank raises
  the same ``RuntimeError`` on every active rank, as Horovod's does.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives

__all__: list = []  # used by the collectives here; nothing for Horovod users

_FIELDS = ("operation", "shape", "data type", "device type", "root rank", "name", "reduction")
_ACTIVE, _JOINED = 0, 1
_SUM, _OTHER = 1, 2  # what a joined rank does: add zeros, or nothing (the active ranks raise)
# dtype codes on the wire; a joined rank rebuilds the zeros from them
_DTYPES: List[torch.dtype] = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_WIDTH = 8  # state, action, wire numel, wire dtype, 4 x 8 bytes of digest

# The states of the ranks at the last announcement on each group: join() reports the last rank to join.
_last_states: Dict[int, List[int]] = {}


def agree(operation: str, tensor: Tensor, group: dist.ProcessGroup, root: Optional[int] = None,
          summed: Optional[Tensor] = None, any_rows: bool = False, name: Optional[str] = None,
          reduction: Optional[str] = None) -> List[int]:
    """Announce a collective; raise the same ``RuntimeError`` on every rank unless the ranks agree.

    Args:
        operation: the collective, e.g. ``"allreduce"``.
        tensor: this rank's tensor.
        group: the group the collective runs on.
        root: the root rank of a broadcast, or None.
        summed: the tensor about to be summed on the wire, when the collective is a sum a
            joined rank can take part in with zeros; None for any other collective.
        any_rows: the first dimension may differ between ranks (allgather, alltoall).
        name: the operation's ``name=``; ranks must agree on it too, as Horovod pairs by it.
        reduction: the reduce op and scale factors of an allreduce, which must agree too.

    Returns:
        With ``any_rows``, every rank's first dimension (one gather tells both).

    Raises:
        RuntimeError: the ranks' shapes, dtypes, devices, roots, names or reductions differ, or a
            rank has joined and the collective is not a sum.
    """
    dims = [str(d) for d in tensor.shape]
    if any_rows and dims:
        dims[0] = "*"
    mine = (operation, f"[{', '.join(dims)}]", str(tensor.dtype).replace("torch.", ""), tensor.device.type, root,
            name, reduction)
    if summed is not None and summed.dtype in _DTYPES:
        action, numel, dtype = _SUM, summed.numel(), _DTYPES.index(summed.dtype)
    else:  # the size slot carries the rows, which may differ between ranks here
        action, numel, dtype = _OTHER, (tensor.shape[0] if any_rows and tensor.dim() else 0), 0
    everyone = _gather([_ACTIVE, action, numel, dtype, *_digest(repr(mine))], group)
    active = [r for r, entry in enumerate(everyone) if entry[0] == _ACTIVE]
    if any(_same_call(everyone[r]) != _same_call(everyone[active[0]]) for r in active):
        descriptions = collectives.all_gather_object(mine, group=group)
        _raise_mismatch(operation, [descriptions[r] for r in active], active, root is not None, any_rows)
    joined = [r for r, entry in enumerate(everyone) if entry[0] == _JOINED]
    if joined and action != _SUM:
        raise RuntimeError(
            f"{operation} cannot run while rank(s) {joined} have called hvd.join(): a joined rank can only "
            "add zeros to an allreduce with op=Sum or Average; call it after hvd.join() returns on every rank"
        )
    return [entry[2] for entry in everyone]


def serve_joined(group: dist.ProcessGroup) -> int:
    """On a rank inside ``hvd.join()``: take part in the others' collectives until every rank joined.

    Returns:
        The last rank to join (the highest of those that joined last), the same on every rank.
    """
    world = dist.get_world_size(group)
    device = _device(group)
    while True:
        before = _last_states.get(_key(group), [_ACTIVE] * world)
        everyone = _gather([_JOINED, 0, 0, 0, 0, 0, 0, 0], group)
        states = [entry[0] for entry in everyone]
        if all(s == _JOINED for s in states):
            del _last_states[_key(group)]  # the next join starts afresh
            return max((r for r in range(world) if before[r] == _ACTIVE), default=world - 1)
        active = [r for r in range(world) if states[r] == _ACTIVE]
        if any(_same_call(everyone[r]) != _same_call(everyone[active[0]]) for r in active):
            collectives.all_gather_object(None, group=group)  # the active ranks gather descriptions to raise
            continue
        _, action, numel, dtype = everyone[active[0]][:4]
        if action == _SUM:
            dist.all_reduce(torch.zeros(numel, dtype=_DTYPES[dtype], device=device), group=group)


def _same_call(entry: List[int]) -> List[int]:
    """What must be equal across the active ranks: all but the size slot (the digest covers shapes)."""
    return entry[:2] + entry[3:]


def _gather(entry: Sequence[int], group: dist.ProcessGroup) -> List[List[int]]:
    mine = torch.tensor(entry, dtype=torch.int64, device=_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    everyone = [t.tolist() for t in gathered]
    _last_states[_key(group)] = [e[0] for e in everyone]
    return everyone


def _key(group: dist.ProcessGroup) -> int:
    return id(group)


def _device(group: dist.ProcessGroup) -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def _digest(text: str) -> List[int]:
    return torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.int64).tolist()


def _raise_mismatch(operation: str, descriptions: list, ranks: List[int], rooted: bool, any_rows: bool) -> None:
    for k, field in enumerate(_FIELDS):
        values = [d[k] for d in descriptions]
        if any(v != values[0] for v in values) and field == "name":
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
            raise RuntimeError(
                f"Mismatched {operation} names across ranks ({detail}); ranks pair collectives by the order "
                "they call them, not by name: call them in the same order, with the same names, on every rank"
            )
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, values))
            raise RuntimeError(
                f"Mismatched {operation} {field}s across ranks ({detail}); every rank must call "
                f"{operation} with a tensor of the same shape"
                + (" (but for the first dimension)" if any_rows else "") + ", data type and device"
                + (" and the same root_rank" if rooted else "") + ", in the same order"
            )
    raise RuntimeError(f"Mismatched {operation} calls across ranks {ranks}: the data types on the wire differ; "
                       "pass the same compression= on every rank")
