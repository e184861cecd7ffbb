"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): low-rank gradients with error feedback.

Each gradient matrix ``M`` (a conv kernel viewed as ``out x rest``) is sent as two thin
factors: ``P = M Q`` (``n x r``), summed over the ranks and orthonormalised, then
``Q = Mᵀ P`` (``m x r``), summed; every rank then holds the same ``P Qᵀ``, the sum
projected onto ``P``'s span. ``Q`` is kept for the next step (the warm start that
makes one power iteration per step enough), and what the projection left out of
this rank's ``M`` is added to its next gradient (error feedback), so nothing is lost
for good, only late.

Per pack, two all-reduces: the first carries every matrix's ``P`` and, uncompressed,
the members too small to gain (vectors, and matrices where ``r (n + m)`` is not at
least ``min_compression_rate`` times smaller than ``n m``); the second every ``Q``.
Before ``start_step`` the packs travel uncompressed (one all-reduce), which helps the
first, large gradients of training settle.

A non-finite gradient (an AMP overflow that ``GradScaler`` will skip) reaches every
rank as non-finite, as without compression; the residual of that round is dropped
and ``Q`` starts afresh, so one overflow does not poison the state for good.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import arguments
from .feedback import Key, keyed_state, load_keyed_state
from .protocol import AllReduce, Codec, Collective, Compressor, PackLayout, Round

__all__ = ["PowerSGD"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Matrix:
    index: int  # the parameter's index: its residual and Q are keyed by it
    offset: int
    rows: int
    cols: int


class PowerSGD(Compressor):
    """Send each gradient matrix as rank-``rank`` factors, with error feedback and a warm-started ``Q``.

    Args:
        rank: the factors' rank r; higher is closer to the exact mean, and sends more (default: 4).
        start_step: rounds sent uncompressed before compression starts (``Round.step``: steps, and in
            local SGD syncs) (default: 0).
        min_compression_rate: a matrix ``n x m`` is compressed only if ``n m`` is at least this
            many times ``r (n + m)`` (default: 2.0).
        seed: the seed of every rank's first ``Q`` (they must match) (default: 0).
        error_feedback: keep what the approximation left out for the next step (default: True).
        warm_start: start each step's power iteration from the last step's ``Q``, rather
            than from a fresh random one (default: True).

    Raises:
        TypeError: a setting of the wrong type (``seed="x"``, ``rank=2.0``), naming it.
        ValueError: a setting out of range.

    Example::

        >>> opt = distopt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
        ...                                    compression=distopt.compression.PowerSGD(rank=4))
        >>> torch.save(opt.state_dict(), f"ckpt-rank{distopt.get_rank()}.pt")  # residuals are per rank
    """

    name = "powersgd"
    per_rank_keys = ("residuals",)  # Q is the same on every rank: it is made of sums

    def __init__(self, rank: int = 4, start_step: int = 0, min_compression_rate: float = 2.0, seed: int = 0,
                 error_feedback: bool = True, warm_start: bool = True) -> None:
        rank = arguments.integer("PowerSGD", "rank", rank, ">= 1")
        start_step = arguments.integer("PowerSGD", "start_step", start_step, ">= 0")
        min_compression_rate = arguments.real("PowerSGD", "min_compression_rate", min_compression_rate, "> 0")
        if rank < 1:
            raise ValueError(f"PowerSGD(rank=) must be an int >= 1, got {rank!r}")
        if start_step < 0:
            raise ValueError(f"PowerSGD(start_step=) must be an int >= 0, got {start_step!r}")
        if not min_compression_rate > 0:
            raise ValueError(f"PowerSGD(min_compression_rate=) must be > 0, got {min_compression_rate!r}")
        self.rank = rank
        self.start_step = start_step
        self.min_compression_rate = min_compression_rate
        self.seed = arguments.integer("PowerSGD", "seed", seed, "any integer, the same on every rank")
        self.error_feedback = arguments.boolean("PowerSGD", "error_feedback", error_feedback)
        self.warm_start = arguments.boolean("PowerSGD", "warm_start", warm_start)
        # Keyed by (exchange, parameter index): gradients and a mode's exchanges keep theirs apart.
        self.residuals: Dict[Key, Tensor] = {}
        # Q is kept transposed (rank x cols): both of a step's products with M then read M row
        # by row, 5-7x faster on CPU than Mᵀ P.
        self.qs: Dict[Key, Tensor] = {}

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, start_step={self.start_step})"

    def settings(self) -> Dict[str, Any]:
        return {"compressor": "PowerSGD", "rank": self.rank, "start_step": self.start_step,
                "min_compression_rate": self.min_compression_rate, "seed": self.seed,
                "error_feedback": self.error_feedback, "warm_start": self.warm_start}

    def codec(self, layout: PackLayout) -> Optional[Codec]:
        if layout.dtype not in _FLOATS:
            return None
        matrices = []
        for index, shape, offset in zip(layout.members, layout.shapes, layout.offsets):
            if len(shape) < 2:
                continue
            rows = shape[0]
            cols = 1
            for s in shape[1:]:
                cols *= s
            if rows * cols >= self.min_compression_rate * self.rank * (rows + cols):
                matrices.append(_Matrix(index, offset, rows, cols))
        return _PowerSGDCodec(self, layout, matrices) if matrices else None

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        if dtype not in _FLOATS:
            return 1.0
        sent = total = 0
        for shape in shapes:
            n = shape.numel()
            total += n
            sent += n
            if len(shape) >= 2:
                rows, cols = shape[0], n // max(shape[0], 1)
                if n >= self.min_compression_rate * self.rank * (rows + cols):
                    sent += self.rank * (rows + cols) - n
        return sent / total if total else 1.0

    def first_q(self, index: int, cols: int, like: Tensor, step: int = 0) -> Tensor:
        """The same ``Qᵀ`` (``rank x cols``) on every rank: drawn from a generator seeded by the seed and
        the parameter (and the step, without a warm start)."""
        # Modulo 2**64, as torch takes a negative seed: any int seed works (2**31 overflowed torch's seed
        # mid-backward), and every seed that worked before draws the same Q.
        gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + index) * 1_000_033 + step) % 2**64)
        return torch.randn(self.rank, cols, generator=gen, dtype=torch.float32).to(like.device, like.dtype)

    def state_dict(self) -> Dict[str, Any]:
        return {"residuals": keyed_state(self.residuals), "qs": keyed_state(self.qs)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        unknown = set(state_dict) - {"residuals", "qs"}
        if unknown:
            raise ValueError(f"not a PowerSGD state: unexpected keys {sorted(unknown)}")
        self.residuals = load_keyed_state(state_dict.get("residuals", {}), "PowerSGD")
        self.qs = load_keyed_state(state_dict.get("qs", {}), "PowerSGD")


class _PowerSGDCodec(Codec):
    def __init__(self, owner: PowerSGD, layout: PackLayout, matrices: List[_Matrix]) -> None:
        self.owner = owner
        self.layout = layout
        self.matrices = matrices
        # The members sent as they are, as (offset, numel) runs of the flat values.
        compressed = {(m.offset, m.rows * m.cols) for m in matrices}
        self.rest = [(o, n) for o, n in _member_spans(layout) if (o, n) not in compressed]
        self.rest_numel = sum(n for _, n in self.rest)

    def reduce(self, data: Tensor, round: Round) -> Iterator[Collective]:
        owner, r = self.owner, self.owner.rank
        if round.step < owner.start_step:
            yield AllReduce(data, last=True)
            return
        # Each matrix's M: its value plus its residual, in the residual's own storage (no copy kept).
        # Residuals are kept in applied units (protocol.py): this round's sum is multiplied by its factor.
        expected = round.factor
        ms: List[Tensor] = []
        for m in self.matrices:
            value = data[m.offset:m.offset + m.rows * m.cols].view(m.rows, m.cols)
            if round.contributing and owner.error_feedback:
                residual = owner.residuals.get((round.exchange, m.index))
                if residual is None:
                    residual = owner.residuals[(round.exchange, m.index)] = torch.zeros_like(value)
                if expected != 1.0:
                    residual.div_(expected)
                ms.append(residual.add_(value))
            else:  # a rank that has joined adds nothing, and keeps its residual for later
                ms.append(value)
        feedback = round.contributing and owner.error_feedback
        qts = []
        for m in self.matrices:
            qt = owner.qs.get((round.exchange, m.index)) if owner.warm_start else None
            if qt is None:
                qt = owner.first_q(m.index, m.cols, data, round.step)
                if owner.warm_start:
                    owner.qs[(round.exchange, m.index)] = qt
            qts.append(qt)
        p_numel = sum(m.rows * r for m in self.matrices)
        first = torch.empty(p_numel + self.rest_numel, dtype=data.dtype, device=data.device)
        ps = _split(first, [(m.rows, r) for m in self.matrices])
        for m_, qt, p in zip(ms, qts, ps):
            torch.mm(m_, qt.t(), out=p)
        at = p_numel
        for offset, n in self.rest:
            first[at:at + n].copy_(data[offset:offset + n])
            at += n
        yield AllReduce(first)
        at = p_numel
        for offset, n in self.rest:
            data[offset:offset + n].copy_(first[at:at + n])
            at += n
        second = torch.empty(sum(m.cols * r for m in self.matrices), dtype=data.dtype, device=data.device)
        new_qts = _split(second, [(r, m.cols) for m in self.matrices])
        for m_, p, qt in zip(ms, ps, new_qts):
            p.copy_(_orthonormal(p))
            torch.mm(p.t(), m_, out=qt)
        yield AllReduce(second, last=True)
        finite = bool(torch.isfinite(second).all())
        # The flags are back (Round.outcome): how many ranks contributed, and the factor the sum is applied at.
        contributors, factor = round.final_contributors, round.final_factor
        for m, m_, p, qt in zip(self.matrices, ms, ps, new_qts):
            value = data[m.offset:m.offset + m.rows * m.cols].view(m.rows, m.cols)
            if feedback:
                if finite:
                    if factor != expected:  # a rank joined in this round: M = x + r / expected becomes x + r / factor,
                        m_.sub_(value).mul_(expected / factor).add_(value)  # so the old residual is applied as owed
                    # The residual: this rank's M less its share of the sum's approximation P Qᵀ (the contributors'
                    # residuals add up to what the approximation left out), in applied units.
                    m_.addmm_(p, qt, alpha=-1.0 / contributors)
                    if factor != 1.0:
                        m_.mul_(factor)
                else:
                    m_.zero_()
            torch.mm(p, qt, out=value)
            if owner.warm_start:
                owner.qs[(round.exchange, m.index)] = (qt.clone() if finite
                                                       else owner.first_q(m.index, m.cols, data, round.step))


def _orthonormal(p: Tensor) -> Tensor:
    """An orthonormal basis of ``p``'s columns (the same on every rank: they hold the same ``p``)."""
    if p.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(p.float()).Q.to(p.dtype)
    return torch.linalg.qr(p).Q


def _split(flat: Tensor, shapes: List[Tuple[int, int]]) -> List[Tensor]:
    out, at = [], 0
    for rows, cols in shapes:
        out.append(flat[at:at + rows * cols].view(rows, cols))
        at += rows * cols
    return out


def _member_spans(layout: PackLayout) -> List[Tuple[int, int]]:
    spans = []
    for shape, offset in zip(layout.shapes, layout.offsets):
        n = 1
        for s in shape:
            n *= s
        spans.append((offset, n))
    return spans
