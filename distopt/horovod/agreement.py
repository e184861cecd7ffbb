"""Every rank passes the same kind of tensor to a collective, or every rank raises.

torch.distributed matches collectives by call order and trusts the tensors to
fit: a shape, dtype, device or root that differs between ranks hangs or
corrupts. Horovod's coordinator checks them; here each ``hvd`` collective first
compares a 32-byte digest of what it was given (one small all-gather), and only
when the digests differ gathers the descriptions, to raise the same
``RuntimeError`` on every rank, naming the ranks and what differs.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from .. import collectives
from ..collectives.tensors import same_everywhere

__all__: list = []  # used by the collectives here; nothing for Horovod users

_FIELDS = ("operation", "shape", "data type", "device type", "root rank")


def agree(operation: str, tensor: Tensor, group: dist.ProcessGroup, root: Optional[int] = None) -> None:
    """Raise the same ``RuntimeError`` on every rank unless every rank passed a like tensor (and root).

    Args:
        operation: the collective, e.g. ``"allreduce"``.
        tensor: this rank's tensor.
        group: the group the collective runs on.
        root: the root rank of a broadcast, or None.

    Raises:
        RuntimeError: the ranks' shapes, dtypes, devices or roots differ.
    """
    mine = (operation, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), tensor.device.type, root)
    if same_everywhere(repr(mine), group):
        return
    everyone = collectives.all_gather_object(mine, group=group)
    for k, field in enumerate(_FIELDS):
        values = [theirs[k] for theirs in everyone]
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {r}: {list(v) if isinstance(v, tuple) else v}" for r, v in enumerate(values))
            raise RuntimeError(
                f"Mismatched {operation} {field}s across ranks ({detail}); every rank must call "
                f"{operation} with a tensor of the same shape, data type and device"
                + (" and the same root_rank" if root is not None else "") + ", in the same order"
            )
