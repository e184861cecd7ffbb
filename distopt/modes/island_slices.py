"""The island's gradients laid out flat and cut into ``k`` slices, for the hierarchical sum of
:class:`distopt.Islands` with synchronous training across.

Per (device, dtype), the trainable parameters' gradients, in the wrapper's order, form one flat
vector, padded to ``k`` slices of equal length. Rank ``j`` of an island sends slice ``j`` across the
islands (the across engine tracks one tensor per (device, dtype), its *slot*, whose pack view
carries it), and the island then gathers its ``k`` slices back into the whole vector and each
gradient.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ..transport import stalls

__all__ = ["SliceGroup", "Slices"]


@dataclasses.dataclass
class SliceGroup:
    """The gradients of one (device, dtype), laid out flat and cut into ``k`` slices of ``length``.

    Attributes:
        key: (device, dtype).
        members: the parameters' indices, in the wrapper's order.
        offsets: each member's first element in the flat layout.
        length: one slice's elements (the layout padded to ``k`` slices).
        slot: the tensor the across engine tracks for this rank's slice (its pack view carries it).
        whole: the gathered layout, ``k * length`` elements.
    """

    key: Tuple[torch.device, torch.dtype]
    members: List[int]
    offsets: List[int]
    length: int
    slot: Tensor
    whole: Tensor

    def read_slice(self, params: List[Tensor], out: Tensor, place: int) -> None:
        """Write slice ``place`` of the flat gradients into ``out`` (zeros where a gradient is None or past the end)."""
        start, stop = place * self.length, (place + 1) * self.length
        out.zero_()
        for i, offset in zip(self.members, self.offsets):
            p = params[i]
            lo, hi = max(start, offset), min(stop, offset + p.numel())
            if lo >= hi or p.grad is None:
                continue
            out[lo - start: hi - start].copy_(p.grad.reshape(-1)[lo - offset: hi - offset])

    def gather(self, view: Tensor, k: int, group: Optional[ProcessGroup], progress: Any) -> Tensor:
        """Every rank's slice of the island, in place order: the whole layout."""
        if k == 1:
            self.whole.copy_(view)
            return self.whole
        with stalls.inspected(progress, "the gather of the island's slices"):
            dist.all_gather_single(self.whole, view.contiguous(), group=group)
        return self.whole

    def write_back(self, params: List[Tensor], whole: Tensor, present: Optional[List[bool]]) -> None:
        """Give each member its global mean; None where no island had a gradient (``present``)."""
        for n, (i, offset) in enumerate(zip(self.members, self.offsets)):
            p = params[i]
            values = whole[offset: offset + p.numel()].view_as(p)
            if present is not None and not present[n]:
                p.grad = None
            elif p.grad is None:
                p.grad = values.clone()
            else:
                p.grad.copy_(values)

    def nbytes(self) -> int:
        """Bytes held: the slot and the gathered layout."""
        return (self.slot.numel() + self.whole.numel()) * self.whole.element_size()


@dataclasses.dataclass
class Slices:
    """The layout of every (device, dtype) group, and which group each across slot is."""

    groups: List[SliceGroup]
    of_slot: Dict[int, int]
    members: Set[int]

    def nbytes(self) -> int:
        """Bytes held by every group (:meth:`SliceGroup.nbytes`)."""
        return sum(group.nbytes() for group in self.groups)

    def add(self, params: List[Tensor], trainable: List[int], k: int) -> List[SliceGroup]:
        """Lay ``params[i]`` for ``i`` in ``trainable`` out in new groups, by (device, dtype), in ``k`` slices.

        Returns:
            The groups added (parameters added later get groups of their own: the others' stay as they are).
        """
        by_key: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        for i in trainable:
            by_key.setdefault((params[i].device, params[i].dtype), []).append(i)
        groups = []
        for key, members in by_key.items():
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += params[i].numel()
            length = -(-total // k)
            device, dtype = key
            slot = torch.zeros(length, dtype=dtype, device=device, requires_grad=True)
            groups.append(SliceGroup(key, members, offsets, length, slot,
                                     torch.zeros(length * k, dtype=dtype, device=device)))
        for group in groups:
            self.of_slot[id(group.slot)] = len(self.groups)
            self.groups.append(group)
        self.members.update(trainable)
        return groups
