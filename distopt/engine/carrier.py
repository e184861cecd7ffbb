"""A compressed pack's control flags, carried in its codec's first all-gather.

Every pack's control flags (:mod:`distopt.planning.control`) are summed over the ranks
each round, exactly. A codec's collectives carry values the codec has rounded, so a
compressed pack's flags travel apart, in a small collective of their own, which on gloo
costs about 0.4 ms of a CPU core: as much as a top-k codec's own arithmetic on a 3 MiB
pack. Where the codec's first collective is an all-gather (``"topk"``, ``"int8"`` and
``"int4"`` at few ranks), the flags ride in it instead: each rank's row of the gather is
its flags, then its part of the codec's all-gather, and once it is back the engine copies
the codec's parts out and adds the flags in rank order. The codec sees none of this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..compression.protocol import AllGather, Collective

__all__ = ["CARRY_MAX_BYTES", "Carrier", "carries_flags"]

#: Bytes a rank may receive in a codec's first all-gather for the pack's flags to ride in it:
#: up to here the copies in and out (10-20 µs per 100 KiB on CPU) cost less than the
#: flags' own collective.
CARRY_MAX_BYTES = 4 << 20

_ALIGN = 16  # bytes: each part of a row starts aligned for any dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def carries_flags(collective: Collective, flags: Tensor, world: int, limit: int = CARRY_MAX_BYTES) -> bool:
    """Whether a codec's first collective can carry its pack's ``flags`` (pure, alike on every rank).

    It can if it is an all-gather of contiguous tensors whose rows, ``world`` of them, fit in
    ``limit`` bytes, and the flags are real floats (a sum of small integers is exact in them).
    """
    if not isinstance(collective, AllGather) or flags.is_complex() or not flags.is_floating_point():
        return False
    part = collective.tensor
    row = _aligned(flags.numel() * flags.element_size()) + _aligned(part.numel() * part.element_size())
    return part.is_contiguous() and collective.out.is_contiguous() and world * row <= limit


@dataclass
class Carrier:
    """The buffers of one pack's all-gather with its flags, kept from round to round.

    Each rank's row is its flags, then its part of the codec's all-gather, as bytes, each
    padded to 16 bytes.

    Example::

        carrier = pack.carrier = Carrier.fitting(pack.carrier, pack.flags, gather.tensor, world)
        carrier.fill(pack.flags, gather.tensor)
        # all-gather carrier.send into the rows of carrier.rows, then:
        carrier.unpack(pack.flags, gather.out, averaged=False)
    """

    send: Tensor  # uint8, this rank's row
    rows: Tensor  # uint8, (world, row bytes): every rank's row
    flag_bytes: int
    part_bytes: int

    @classmethod
    def fitting(cls, current: Optional["Carrier"], flags: Tensor, part: Tensor, world: int) -> "Carrier":
        """``current`` if it fits ``flags`` and ``part`` at ``world`` ranks, else a new one."""
        flag_bytes = flags.numel() * flags.element_size()
        part_bytes = part.numel() * part.element_size()
        if current is not None and (current.flag_bytes, current.part_bytes, current.rows.shape[0]) == (
                flag_bytes, part_bytes, world):
            return current
        rows = torch.empty(world, _aligned(flag_bytes) + _aligned(part_bytes), dtype=torch.uint8, device=part.device)
        return cls(torch.empty_like(rows[0]), rows, flag_bytes, part_bytes)

    def fill(self, flags: Tensor, part: Tensor) -> None:
        """This rank's row: its ``flags`` and its ``part`` of the all-gather."""
        at = _aligned(self.flag_bytes)
        self.send[:self.flag_bytes].copy_(flags.reshape(-1).view(torch.uint8))
        self.send[at:at + self.part_bytes].copy_(part.reshape(-1).view(torch.uint8))

    def unpack(self, flags: Tensor, out: Tensor, averaged: bool) -> None:
        """Every rank's part into the codec's ``out``, in rank order, and into ``flags`` the sum of every
        rank's flags, added in rank order (alike on every rank), divided by the world where
        ``averaged`` (where the engine's other flags are averaged by the backend, as they would be).
        """
        world, at = self.rows.shape[0], _aligned(self.flag_bytes)
        out.reshape(-1).view(torch.uint8).view(world, self.part_bytes).copy_(self.rows[:, at:at + self.part_bytes])
        each = self.rows[:, :self.flag_bytes].view(flags.dtype)
        flags.copy_(each[0])
        for r in range(1, world):
            flags.add_(each[r])
        if averaged:
            flags.div_(world)
