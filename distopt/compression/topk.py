"""``compression="topk"``: one value in every group of ``group_size`` travels, the rest wait as error feedback.

Each rank sends, of every group of ``group_size`` values, the one of largest magnitude,
as a bfloat16 value and a one-byte position: 3 bytes for ``group_size`` values, 1/85
of float32 at the default 64, and a tenth of what ``"int4"`` sends. What was not sent
(and the bfloat16 rounding of what was) stays in this rank's residual and is added to
its next values, so a value that is small at every round still travels once it has
grown large enough: over many rounds the sum of what was sent follows the sum of the
true values. Top-k selection with error feedback is what SparseLoCo (Sarfi et al.
2025, arXiv 2508.15706) sends for DiLoCo's outer gradients; it suits values that pile
up between rounds, such as local SGD's pseudo-gradients, better than gradients, which
a synchronous step needs now.

**The groups interleave.** The pack's values, padded, are read as a ``group_size x G``
matrix: group ``j`` is column ``j``, the values ``j, j + G, j + 2 G, ...``. The
selection is then one vectorised maximum across the rows, with the row carried in the
low bits of each magnitude's float32 bits (a positive float orders as its bits do),
instead of a ``topk`` over short rows, which is about ten times slower on CPU.

**How the values travel.** One all-gather of every rank's values and positions; each
rank adds the ranks' values into the positions in rank order, so every rank ends with
the same sum, bitwise. A sparse sum cannot be all-reduced as it is (the ranks pick
different positions), and each rank's message is ``3 G`` bytes, so every rank receives
``(world - 1) * 3 G`` bytes, ``3 world / (8 group_size)`` of what a ring all-reduce of
the float32 values brings it (``2 (world - 1) / world`` times 4 bytes a value): fewer for
up to ``8 group_size / 3`` ranks (170 at 64).

**Non-finite values.** An infinite or NaN magnitude is the largest of its group, so it
travels and reaches every rank's sum, as without compression (a ``GradScaler`` then
skips the step on every rank); every rank sees it in the same bytes and drops its
residual, so the next rounds are clean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence

import torch
from torch import Tensor

from . import arguments
from .feedback import Key, PackResiduals, keyed_state, load_residuals
from .protocol import AllGather, Codec, Collective, Compressor, PackLayout, Round

__all__ = ["TopK", "select_largest"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def select_largest(values: Tensor, group_size: int, work: Optional[Tensor] = None) -> Tensor:
    """The row of the largest magnitude in each column of ``values`` read as ``group_size x G`` (int32, G long).

    Magnitudes equal to within the lowest ``log2(group_size)`` bits of their float32 mantissa
    (a relative 2^-17 at 64) count as equal, and the later row wins: the row is kept in those
    bits. NaN is larger than every number, and infinity than every finite one.

    Args:
        values: float32, a multiple of ``group_size`` long.
        group_size: a power of two, at most 2^8.
        work: float32 scratch as long as ``values``, or None.
    """
    rows = values.view(torch.int32).view(group_size, -1)
    if work is None:
        work = torch.empty_like(values, dtype=torch.float32)
    # One pass for the magnitude and the room for the row: clear the sign bit and the lowest bits.
    keys = torch.bitwise_and(rows, 0x7FFFFFFF & -group_size, out=work.view(torch.int32).view(rows.shape))
    keys.bitwise_or_(torch.arange(group_size, dtype=torch.int32, device=values.device).unsqueeze(1))
    return keys.amax(dim=0).bitwise_and_(group_size - 1)


class TopK(Compressor):
    """Send the largest-magnitude value of every group of ``group_size`` values, with error feedback.

    Args:
        group_size: values per group, of which one travels: a power of two from 2 to 256 (default: 64).

    Raises:
        TypeError: ``group_size`` is not an int.
        ValueError: ``group_size`` is not a power of two from 2 to 256.

    Example::

        >>> opt = distopt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=16,
        ...                                    sync_fragments=4, sync_overlap=2, outer_optimizer=nesterov,
        ...                                    compression=distopt.compression.TopK(group_size=64))
    """

    name = "topk"
    per_rank_keys = ("residuals",)

    def __init__(self, group_size: int = 64) -> None:
        group_size = arguments.integer("TopK", "group_size", group_size, "a power of two from 2 to 256")
        if not 2 <= group_size <= 256 or group_size & (group_size - 1):
            # A power of two: the row travels in the low bits of the selection's keys, and in one byte.
            raise ValueError(f"TopK(group_size=) must be a power of two from 2 to 256, got {group_size!r}")
        self.group_size = group_size
        # (exchange, parameter index) -> its residual: a view of its pack's padded residual buffer.
        self.residuals: Dict[Key, Tensor] = {}
        self.loads = 0  # load_state_dict() calls: codecs rebuild their buffers from the loaded residuals

    def __repr__(self) -> str:
        return f"TopK(group_size={self.group_size})"

    def settings(self) -> Dict[str, Any]:
        return {"compressor": "TopK", "group_size": self.group_size}

    def codec(self, layout: PackLayout) -> Optional[Codec]:
        return _TopKCodec(self, layout) if layout.dtype in _FLOATS else None

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        if dtype not in _FLOATS:
            return 1.0
        return 3 / (self.group_size * torch.empty(0, dtype=dtype).element_size())

    def state_dict(self) -> Dict[str, Any]:
        return {"residuals": keyed_state(self.residuals)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.residuals = load_residuals(state_dict, "TopK")
        self.loads += 1


@dataclass
class _Scratch:
    """The buffers of one pack's reduction, allocated once (a fresh pack-sized tensor costs page faults)."""

    work: Tensor  # float32, the padded pack: the selection's keys, then (a 16- or 64-bit pack) the sum
    columns: Tensor  # int64, 0 .. G - 1
    piece: Tensor  # uint8, this rank's message: G bfloat16 values, then G one-byte rows
    gathered: Tensor  # uint8, every rank's message
    world: int

    @classmethod
    def make(cls, world: int, padded: int, group_size: int, device: torch.device) -> "_Scratch":
        groups = padded // group_size
        return cls(torch.empty(padded, dtype=torch.float32, device=device),
                   torch.arange(groups, dtype=torch.int64, device=device),
                   torch.empty(3 * groups, dtype=torch.uint8, device=device),
                   torch.empty(world, 3 * groups, dtype=torch.uint8, device=device), world)


class _TopKCodec(Codec):
    def __init__(self, owner: TopK, layout: PackLayout) -> None:
        self.owner = owner
        self.residuals = PackResiduals(layout, owner)
        self.scratch: Optional[_Scratch] = None

    def reduce(self, data: Tensor, round: Round) -> Iterator[Collective]:
        owner, world = self.owner, round.world_size
        size = owner.group_size
        n = data.numel()
        # An even number of groups keeps every rank's bfloat16 values 2-byte aligned in the gathered rows.
        padded = -(-n // (2 * size)) * 2 * size
        groups = padded // size
        residual = self.residuals.buffer(round.exchange, padded, data.device)
        scratch = self.scratch
        if scratch is None or scratch.work.numel() != padded or scratch.world != world:
            scratch = self.scratch = _Scratch.make(world, padded, size, data.device)
        values, rows = scratch.piece[:2 * groups].view(torch.bfloat16), scratch.piece[2 * groups:]
        expected = round.factor
        if round.contributing:
            if expected != 1.0:  # kept in applied units (protocol.py); this round's sum is applied at its factor
                residual.div_(expected)
            residual[:n].add_(data)
            chosen = select_largest(residual, size, scratch.work)
            positions = chosen.to(torch.int64).mul_(groups).add_(scratch.columns)
            values.copy_(residual.take(positions))
            rows.copy_(chosen)
            # What travels leaves the residual; its bfloat16 rounding stays there. (index_add_ with
            # positions that differ, one a group, is exact and alike wherever it runs: no two adds meet.)
            residual.index_add_(0, positions, values.to(torch.float32), alpha=-1)
        else:  # a joined rank sends zeros and keeps its residual for later
            values.zero_()
            rows.zero_()
        yield AllGather(scratch.piece, scratch.gathered.view(-1), last=True)
        factor = round.final_factor  # the flags are back
        if round.contributing and (expected != 1.0 or factor != expected):
            # Back to applied units: what was left out of this round at the factor expected, and, where a
            # rank joined in it, (factor - expected) times what this rank's values lacked of what it sent,
            # so that the residual grows by factor * (values - sent) (protocol.py). ``data`` is still the values.
            residual.mul_(expected)
            if factor != expected:
                residual[:n].add_(data, alpha=factor - expected)
                residual.index_add_(0, positions, values.to(torch.float32), alpha=expected - factor)
        gathered = scratch.gathered
        everyones = gathered[:, :2 * groups].view(torch.bfloat16).to(torch.float32)
        if not bool(torch.isfinite(everyones).all()):  # the same bytes on every rank: each drops its poisoned residual
            residual.zero_()
        # A float32 pack takes the sum in place; another is summed in float32 and cast once.
        total = data if data.dtype == torch.float32 else scratch.work[:n]
        total.zero_()
        for source in range(world):  # in rank order: the same float sum on every rank
            at = gathered[source, 2 * groups:].to(torch.int64).mul_(groups).add_(scratch.columns)
            # A group whose largest magnitude lay in the padding sent +0.0 from there (the padding of
            # the residual is never written); adding it to the last value instead leaves that value be.
            total.index_add_(0, at.clamp_(max=n - 1), everyones[source])
        if total is not data:
            data.copy_(total)
