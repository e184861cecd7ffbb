"""``compression="sign"``: EF-signSGD, one bit a value and a scale per parameter, with error feedback.

Each rank sends, of each parameter's values ``x`` (its values plus its residual), the signs
of ``x`` and one float32 scale, the mean magnitude ``mean |x|``: it sends ``mean |x| * sign(x)``,
which keeps the parameter's l1 norm. What that leaves out stays in the rank's residual and
is added to its next values (Karimireddy, Rebjock, Stich and Jaggi, "Error Feedback Fixes
SignSGD and other Gradient Compression Schemes", ICML 2019): without it, signs alone do
not converge in general; with it, they follow the true sum as the other compressors do. A
value of zero travels as ``+scale``; error feedback takes it back at the next round.

**How the values travel.** Bits from different ranks cannot be summed as bits, so one
all-gather brings every rank's bits and scales, and each rank decodes them and adds them
in float32 in rank order: every rank holds the same sum, bitwise. Each rank's message is
``n / 8`` bytes plus 4 a parameter (1/32 of float32's bytes), so every rank receives
``(world - 1) n / 8`` bytes, ``world / 64`` of what a ring all-reduce of float32 values
brings it: fewer for up to 64 ranks.

**The bits are planar.** Byte ``i`` of a message holds the signs of values ``i``, ``i + B``,
..., ``i + 7 B`` (``B`` bytes of bits), so packing and unpacking are eight contiguous slices,
not bit operations on interleaved values.

**Non-finite values.** A parameter with an infinite or NaN value gets a non-finite scale,
which reaches every rank's sum for that parameter, as without compression (a ``GradScaler``
then skips the step on every rank); every rank sees it in the same bytes and drops its
residual, so the next rounds are clean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence

import torch
from torch import Tensor

from .feedback import Key, PackResiduals, fold_residual, keyed_state, load_residuals, settle_residual
from .protocol import AllGather, Codec, Collective, Compressor, PackLayout, Round

__all__ = ["Sign"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Sign(Compressor):
    """Send each parameter's values as their signs and their mean magnitude, with error feedback (EF-signSGD).

    Example::

        >>> opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                                    compression=distopt.compression.Sign())  # or "sign"
    """

    name = "sign"
    per_rank_keys = ("residuals",)

    def __init__(self) -> None:
        # (exchange, parameter index) -> its residual: a view of its pack's padded residual buffer.
        self.residuals: Dict[Key, Tensor] = {}
        self.loads = 0  # load_state_dict() calls: codecs rebuild their buffers from the loaded residuals

    def __repr__(self) -> str:
        return "Sign()"

    def settings(self) -> Dict[str, Any]:
        return {"compressor": "Sign"}

    def codec(self, layout: PackLayout) -> Optional[Codec]:
        return _SignCodec(self, layout) if layout.dtype in _FLOATS and layout.numel else None

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        total = sum(shape.numel() for shape in shapes)
        if dtype not in _FLOATS or not total:
            return 1.0
        return (total / 8 + 4 * len(shapes)) / (total * torch.empty(0, dtype=dtype).element_size())

    def state_dict(self) -> Dict[str, Any]:
        return {"residuals": keyed_state(self.residuals)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.residuals = load_residuals(state_dict, "Sign")
        self.loads += 1


@dataclass
class _Scratch:
    """The buffers of one pack's reduction, allocated once (a fresh pack-sized tensor costs page faults)."""

    work: Tensor  # float32, the padded pack: what this rank sent, then (a pack not of float32) the sum
    decoded: Tensor  # float32, the padded pack: one rank's decoded values
    piece: Tensor  # uint8, this rank's message: the bits, then a float32 scale per member
    gathered: Tensor  # uint8, every rank's message
    world: int

    @classmethod
    def make(cls, world: int, padded: int, members: int, device: torch.device) -> "_Scratch":
        width = padded // 8 + 4 * members
        return cls(torch.empty(padded, dtype=torch.float32, device=device),
                   torch.empty(padded, dtype=torch.float32, device=device),
                   torch.empty(width, dtype=torch.uint8, device=device),
                   torch.empty(world, width, dtype=torch.uint8, device=device), world)


class _SignCodec(Codec):
    def __init__(self, owner: Sign, layout: PackLayout) -> None:
        self.owner = owner
        self.residuals = PackResiduals(layout, owner)
        # Each member's values, as (offset, numel): a loop over them is contiguous work, where expanding the
        # scales to one per value (repeat_interleave) or a segmented sum cost several times more on CPU.
        self.spans = [(offset, shape.numel()) for offset, shape in zip(layout.offsets, layout.shapes)]
        self.sizes = torch.tensor([max(n, 1) for _, n in self.spans], dtype=torch.float32, device=layout.device)
        self.shifts = torch.arange(8, dtype=torch.uint8, device=layout.device).unsqueeze(1)
        self.scratch: Optional[_Scratch] = None

    def _decode(self, message: Tensor, n: int, out: Tensor) -> Tensor:
        """One rank's message as its values: ``+scale`` or ``-scale`` of each value's parameter, zeros past ``n``."""
        plane = out.numel() // 8
        bits = torch.bitwise_right_shift(message[:plane].unsqueeze(0), self.shifts).bitwise_and_(1)
        out.view(8, plane).copy_(bits)
        out.mul_(-2.0).add_(1.0)  # bit 0: +1, bit 1: -1
        scales = message[plane:].view(torch.float32)
        for i, (at, size) in enumerate(self.spans):
            out[at:at + size].mul_(scales[i])
        out[n:].zero_()
        return out

    def reduce(self, data: Tensor, round: Round) -> Iterator[Collective]:
        n, members = data.numel(), len(self.spans)
        padded = -(-n // 32) * 32  # whole bytes of bits, and a multiple of 4 bytes: the scales stay aligned
        plane = padded // 8
        residual = self.residuals.buffer(round.exchange, padded, data.device)
        scratch = self.scratch
        if scratch is None or scratch.work.numel() != padded or scratch.world != round.world_size:
            scratch = self.scratch = _Scratch.make(round.world_size, padded, members, data.device)
        piece, sent = scratch.piece, scratch.work
        scales = piece[plane:].view(torch.float32)
        if round.contributing:
            fold_residual(residual, data, round)  # kept in applied units; this round's sum is applied at its factor
            magnitudes = torch.abs(residual[:n], out=scratch.decoded[:n])
            for i, (at, size) in enumerate(self.spans):
                torch.sum(magnitudes[at:at + size], dim=0, out=scales[i])
            scales.div_(self.sizes)  # each member's mean magnitude
            # The sign bits, 0 or 1 a byte (a bool's byte), shifted to their place in the planar bytes.
            negative = torch.signbit(residual).view(torch.uint8).view(8, plane).bitwise_left_shift_(self.shifts)
            torch.sum(negative, dim=0, dtype=torch.uint8, out=piece[:plane])
            residual.sub_(self._decode(piece, n, sent))  # what it left out, in this round's units
        else:  # a joined rank sends zeros (scale 0) and keeps its residual for later
            piece.zero_()
        yield AllGather(piece, scratch.gathered.view(-1), last=True)
        if round.contributing:  # the flags are back: the residual in applied units (``data`` is still the values)
            settle_residual(residual, data, round, lambda: sent)
        gathered = scratch.gathered
        if not bool(torch.isfinite(gathered[:, plane:].contiguous().view(torch.float32)).all()):
            residual.zero_()  # the same bytes on every rank: each drops its poisoned residual
        # A float32 pack takes the sum in place; another is summed in float32 and cast once.
        total = data if data.dtype == torch.float32 else sent[:n]
        total.zero_()
        for source in range(round.world_size):  # in rank order: the same float sum on every rank
            total.add_(self._decode(gathered[source], n, scratch.decoded)[:n])
        if total is not data:
            data.copy_(total)
