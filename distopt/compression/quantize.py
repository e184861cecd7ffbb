"""``compression="int8"`` and ``"int4"``: blockwise absmax quantisation with error feedback.

Each block of ``block_size`` values travels as ``bits``-bit integers and one float32
scale (its largest magnitude over the largest integer), so one outlier costs the
precision of its own block only.

**Why not one all-reduce of the integers.** A sum of int8 values overflows int8, and
each rank's values carry a scale of its own, so integers from two ranks cannot be
added as integers at all. Each rank decodes the others' values and adds them in
float32 instead, in rank order, so every rank ends with the same values, bitwise,
since all decode the same bytes. How the bytes travel depends on the ranks:

* *Two ranks (or one): one all-gather, in ``bits`` bits.* Each rank sends its whole
  pack's codes and scales, and adds both ranks' decoded values. Each rank sends and
  receives the pack once, as the two stages below would at two ranks, but in one
  collective (so nothing is left to issue while the pack travels), with a third less
  quantising and one quantisation error instead of two.
* *More ranks: two stages.* Sending every rank the whole pack would cost ``world - 1``
  packs, so the pack is cut into one chunk per rank:

  1. *all-to-all*: rank ``j`` receives every rank's chunk ``j``, with its scales, and
     adds them in float32 (the reduce-scatter, done where it is exact);
  2. *all-gather*: each rank quantises its chunk of the sum once more and every rank
     receives every chunk.

  Each rank sends and receives ``2 (world - 1) / world`` of the pack in ``bits`` bits,
  what a ring all-reduce sends in float32: 4x (int8) or 8x (int4) fewer bytes, plus
  ``32 / block_size`` bits a value for the scales.

**Error feedback.** What quantising left out of this rank's values is added to its
next values; in two stages, what re-quantising the sum left out (stage 2) is added by
the chunk's owner to its next values, where it enters the next sum once. So the
errors are delayed, never dropped: over many steps the sum of what was sent follows
the sum of the true values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import arguments
from .feedback import Key, PackResiduals, fold_residual, keyed_state, load_residuals, settle_residual
from .protocol import AllGather, AllToAll, Codec, Collective, Compressor, PackLayout, Round

__all__ = ["Quantize", "quantize_blocks", "dequantize_blocks"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def quantize_blocks(values: Tensor, bits: int, block_size: int, work: Optional[Tensor] = None,
                    subtract_from: Optional[Tensor] = None, parts: int = 1) -> Tuple[Tensor, Tensor]:
    """Quantise ``values`` (a multiple of ``block_size`` long) blockwise: ``(codes, scales)``.

    Codes are bytes (uint8). At 8 bits a byte is one integer in two's complement. At 4 bits
    a byte holds two integers of the same part: byte ``i`` of a part of ``2h`` values holds
    value ``i`` plus 8 in its low nibble and value ``h + i`` in two's complement in its
    high nibble. So zero is exact, and encoding is contiguous float arithmetic and one
    float-to-int8 conversion: on CPU, float-to-uint8 conversions and bit operations on
    interleaved nibbles are about 10x slower. Scales are float32.

    Args:
        values: what to quantise.
        bits: 8 or 4.
        block_size: values per scale.
        work: float32 scratch as long as ``values`` (a codec keeps one, since allocating
            a pack-sized tensor costs more than the arithmetic), or None.
        subtract_from: a float32 tensor as long as ``values`` from which the decoded values
            are subtracted, in place (error feedback: it may be ``values`` itself), or None.
        parts: equal parts, each a whole number of blocks, whose codes and scales can be
            sent and decoded apart (a codec's chunk per rank).
    """
    top = (1 << (bits - 1)) - 1
    blocks = values.view(-1, block_size)
    if work is None:
        work = torch.empty(blocks.shape, dtype=torch.float32, device=values.device)
    work = work.view(blocks.shape)
    scales = torch.abs(blocks, out=work).amax(dim=1).div_(top)
    # A block of zeros keeps scale 0 (decodes to zeros): dividing it by 1 avoids 0/0. Dividing, not
    # multiplying by the reciprocal: that of a subnormal scale is inf, and a zero times it NaN.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    integers = torch.div(blocks, divisor, out=work).round_().clamp_(-top, top)
    if subtract_from is not None:  # the decoded values are the integers times their scale, exactly
        subtract_from.view(blocks.shape).addcmul_(integers, scales.unsqueeze(1), value=-1.0)
    flat = integers.view(-1)
    if bits == 4:
        halves = flat.view(parts, 2, -1)
        flat = halves[:, 0].add_(halves[:, 1], alpha=16).add_(top + 1)  # in [-111, 127]: one int8
    codes = torch.empty(flat.shape, dtype=torch.int8, device=values.device)
    codes.copy_(flat)
    codes = codes.view(-1)
    return codes.view(torch.uint8), scales


def dequantize_blocks(codes: Tensor, scales: Tensor, bits: int, block_size: int, out: Tensor,
                      parts: int = 1) -> Tensor:
    """Decode :func:`quantize_blocks`' output into ``out`` (float32, ``len(scales) * block_size``).

    ``parts`` is as given to :func:`quantize_blocks`; a single part of its output decodes with 1.
    """
    signed = codes.view(torch.int8)
    if bits == 8:
        out.copy_(signed)
    else:
        halves, signed = out.view(parts, 2, -1), signed.view(parts, -1)
        high = torch.mul(signed, 1.0 / 16, out=halves[:, 1]).floor_()  # the low nibble (1..15) floors away
        torch.add(signed, high, alpha=-16, out=halves[:, 0]).sub_(8)
    return out.view(-1, block_size).mul_(scales.unsqueeze(1)).view(out.shape)


class Quantize(Compressor):
    """Send float packs as ``bits``-bit integers with a float32 scale per block, with error feedback.

    Args:
        bits: 8 or 4 (default: 8).
        block_size: values per scale; a multiple of 8 (default: 256).

    Raises:
        TypeError: ``bits`` or ``block_size`` is not an int (``bits=8.0``).
        ValueError: ``bits`` is not 8 or 4, or ``block_size`` is not a positive multiple of 8.

    Example::

        >>> opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                    sync_every=16, compression=distopt.compression.Quantize(bits=4))
    """

    per_rank_keys = ("residuals",)

    def __init__(self, bits: int = 8, block_size: int = 256) -> None:
        bits = arguments.integer("Quantize", "bits", bits, "8 or 4")
        block_size = arguments.integer("Quantize", "block_size", block_size, "a positive multiple of 8")
        if bits not in (4, 8):
            raise ValueError(f"Quantize(bits=) must be 8 or 4, got {bits!r}")
        if block_size < 8 or block_size % 8:
            # a multiple of 8 keeps every chunk's scales 4-byte aligned in the messages, at 4 bits too
            raise ValueError(f"Quantize(block_size=) must be a positive multiple of 8, got {block_size!r}")
        self.bits = bits
        self.block_size = block_size
        self.name = f"int{bits}"
        # (exchange, parameter index) -> its residual: a view of its pack's padded residual buffer.
        self.residuals: Dict[Key, Tensor] = {}
        self.loads = 0  # load_state_dict() calls: codecs rebuild their buffers from the loaded residuals

    def __repr__(self) -> str:
        return f"Quantize(bits={self.bits}, block_size={self.block_size})"

    def settings(self) -> Dict[str, Any]:
        return {"compressor": "Quantize", "bits": self.bits, "block_size": self.block_size}

    def codec(self, layout: PackLayout) -> Optional[Codec]:
        return _QuantizeCodec(self, layout) if layout.dtype in _FLOATS else None

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        if dtype not in _FLOATS:
            return 1.0
        return (self.bits / 8 + 4 / self.block_size) / torch.empty(0, dtype=dtype).element_size()

    def state_dict(self) -> Dict[str, Any]:
        return {"residuals": keyed_state(self.residuals)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.residuals = load_residuals(state_dict, "Quantize")
        self.loads += 1


class _QuantizeCodec(Codec):
    def __init__(self, owner: Quantize, layout: PackLayout) -> None:
        self.owner = owner
        self.residuals = PackResiduals(layout, owner)
        self.scratch: Union[_Scratch, _GatherScratch, None] = None  # the buffers of one reduction, kept for the next

    def reduce(self, data: Tensor, round: Round) -> Iterator[Collective]:
        if round.world_size <= 2:
            return self._gather_whole(data, round)
        return self._two_stages(data, round)

    def _values(self, data: Tensor, round: Round, padded: int) -> Tuple[Tensor, Tensor]:
        """``(values to quantise, this rank's residual)``: the residual plus ``data``, or a joined rank's zeros."""
        residual = self.residuals.buffer(round.exchange, padded, data.device)
        if not round.contributing:  # a joined rank sends zeros and keeps its residual for later
            return torch.zeros(padded, dtype=torch.float32, device=data.device), residual
        fold_residual(residual, data, round)  # kept in applied units; this round's sum is applied at its factor
        return residual, residual

    def _gather_whole(self, data: Tensor, round: Round) -> Iterator[Collective]:
        """Every rank's whole codes in one all-gather; each rank decodes them all and adds them in rank order."""
        world, bits, block = round.world_size, self.owner.bits, self.owner.block_size
        n = data.numel()
        padded = -(-n // block) * block
        values, residual = self._values(data, round, padded)
        scratch = self.scratch
        if not isinstance(scratch, _GatherScratch) or scratch.work.numel() != padded or scratch.world != world:
            scratch = self.scratch = _GatherScratch.make(world, padded, bits, block, data.device)
        codes, scales = quantize_blocks(values, bits, block, scratch.work, residual if round.contributing else None)
        piece, code_bytes = scratch.piece, scratch.code_bytes
        piece[:code_bytes].copy_(codes)
        piece[code_bytes:].copy_(scales.view(torch.uint8))
        yield AllGather(piece, scratch.gathered.view(-1), last=True)
        decoded = [dequantize_blocks(row[:code_bytes], row[code_bytes:].view(torch.float32), bits, block, out)
                   for row, out in zip(scratch.gathered, (scratch.work, scratch.other))]
        if round.contributing:  # before ``data`` takes the sum: it is still this rank's values
            settle_residual(residual, data, round, lambda: decoded[round.rank])
        self._drop_poisoned(scratch.gathered[:, code_bytes:], residual)
        if world == 1:
            data.copy_(decoded[0][:n])
        else:  # rank 0's values plus rank 1's, on every rank: the same float sum
            torch.add(decoded[0][:n], decoded[1][:n], out=data)

    def _two_stages(self, data: Tensor, round: Round) -> Iterator[Collective]:
        """An all-to-all of every rank's chunks, summed by their owners, then an all-gather of the sums."""
        world, bits, block = round.world_size, self.owner.bits, self.owner.block_size
        n = data.numel()
        chunk = -(-n // (world * block)) * block  # values per rank's chunk, whole blocks
        padded = chunk * world
        values, residual = self._values(data, round, padded)
        scratch = self.scratch
        if not isinstance(scratch, _Scratch) or scratch.work.numel() != padded or scratch.send.shape[0] != world:
            scratch = self.scratch = _Scratch.make(world, chunk, bits, block, data.device)
        work, code_bytes = scratch.work, scratch.code_bytes
        codes, scales = quantize_blocks(values, bits, block, work, residual if round.contributing else None,
                                        parts=world)
        # One message per destination: its chunk's codes, then their scales' bytes.
        send, recv = scratch.send, scratch.recv
        send[:, :code_bytes].copy_(codes.view(world, code_bytes))
        send[:, code_bytes:].copy_(scales.view(world, -1).view(torch.uint8))
        yield AllToAll(send.view(-1), recv.view(-1))
        mine, decoded = scratch.mine.zero_(), scratch.decoded
        for source in range(world):  # in rank order: the same float sum wherever it is done
            row = recv[source]
            mine.add_(dequantize_blocks(row[:code_bytes], row[code_bytes:].view(torch.float32), bits, block, decoded))
        if round.contributing:  # the flags are back: stage 1's residual in applied units (``work`` is free again)
            settle_residual(residual, data, round, lambda: self._decode_rows(send, bits, block, work))
        # What re-quantising the sum leaves out goes into the chunk owner's next values, a joined rank's too
        # (it keeps them for after its block), applied units at this round's factor: it is part of this sum.
        factor = round.final_factor
        if not round.contributing and round.outcome.exchange is not None:  # a joined rank learns what the round was
            residual = self.residuals.buffer(round.outcome.exchange, padded, data.device)
        own = residual[round.rank * chunk:(round.rank + 1) * chunk]
        if factor != 1.0:
            own.div_(factor)
        own.add_(mine)
        codes2, scales2 = quantize_blocks(mine, bits, block, work[:chunk], own)
        if factor != 1.0:
            own.mul_(factor)
        piece, gathered = scratch.piece, scratch.gathered
        piece[:code_bytes].copy_(codes2)
        piece[code_bytes:].copy_(scales2.view(torch.uint8))
        yield AllGather(piece, gathered.view(-1), last=True)
        total = work
        for source in range(world):
            row = gathered[source]
            dequantize_blocks(row[:code_bytes], row[code_bytes:].view(torch.float32), bits, block,
                              total[source * chunk:(source + 1) * chunk])
        self._drop_poisoned(gathered[:, code_bytes:], residual)
        data.copy_(total[:n])

    @staticmethod
    def _decode_rows(rows: Tensor, bits: int, block: int, out: Tensor) -> Tensor:
        """Every chunk of this rank's all-to-all message (one row per destination), decoded into ``out``."""
        world = rows.shape[0]
        chunk = out.numel() // world
        code_bytes = chunk * bits // 8
        for j in range(world):
            dequantize_blocks(rows[j, :code_bytes], rows[j, code_bytes:].view(torch.float32), bits, block,
                              out[j * chunk:(j + 1) * chunk])
        return out

    @staticmethod
    def _drop_poisoned(scale_bytes: Tensor, residual: Tensor) -> None:
        """A value decodes finite exactly when its block's scale is finite: an overflow or a NaN makes the
        scale so. Every rank sees it in the same bytes; each drops its poisoned residual."""
        if not bool(torch.isfinite(scale_bytes.contiguous().view(torch.float32)).all()):
            residual.zero_()


def _message_bytes(values: int, bits: int, block: int) -> Tuple[int, int]:
    """``(code bytes, message bytes)`` of ``values`` quantised values: their codes, then a float32 scale per block."""
    code_bytes = values * bits // 8
    return code_bytes, code_bytes + 4 * (values // block)


@dataclass
class _GatherScratch:
    """The buffers of one pack's reduction in one all-gather, allocated once."""

    work: Tensor  # float32, the padded pack: the quantiser's scratch, then rank 0's decoded values
    other: Tensor  # float32, rank 1's decoded values (empty at one rank)
    piece: Tensor  # uint8, this rank's codes, then scales
    gathered: Tensor  # uint8, every rank's piece
    code_bytes: int
    world: int

    @classmethod
    def make(cls, world: int, padded: int, bits: int, block: int, device: torch.device) -> "_GatherScratch":
        code_bytes, width = _message_bytes(padded, bits, block)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(padded, **f32), torch.empty(padded if world > 1 else 0, **f32),
                   torch.empty(width, dtype=torch.uint8, device=device),
                   torch.empty(world, width, dtype=torch.uint8, device=device), code_bytes, world)


@dataclass
class _Scratch:
    """The buffers of one pack's reduction in two stages: allocated once, since a fresh pack-sized
    tensor costs page faults on every step."""

    work: Tensor  # float32, the padded pack
    send: Tensor  # uint8, one row per destination: codes, then scales
    recv: Tensor
    mine: Tensor  # float32, this rank's chunk of the sum
    decoded: Tensor  # float32, a chunk
    piece: Tensor  # uint8, this rank's row of the all-gather
    gathered: Tensor
    code_bytes: int

    @classmethod
    def make(cls, world: int, chunk: int, bits: int, block: int, device: torch.device) -> "_Scratch":
        code_bytes, width = _message_bytes(chunk, bits, block)
        u8 = dict(dtype=torch.uint8, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(chunk * world, **f32), torch.empty(world, width, **u8), torch.empty(world, width, **u8),
                   torch.empty(chunk, **f32), torch.empty(chunk, **f32), torch.empty(width, **u8),
                   torch.empty(world, width, **u8), code_bytes)
