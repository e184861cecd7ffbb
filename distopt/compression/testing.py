"""Run a compressor's codecs for several simulated ranks in one process: for its tests, and timings.

No process group and no network: :func:`simulate` runs one round of every rank's codec
(:meth:`Codec.reduce <distopt.compression.protocol.Codec.reduce>`) and carries out each
collective they yield by hand, as the engine would issue it, while checking what the
engine's fixed plan relies on: every rank yields the same collective, of the same kind,
sizes, dtypes and ``last``, at the same point, nothing after a collective marked last, and
every rank's values end the same, bitwise. It fills in what the engine fills in: a rank
that does not contribute (it has joined) gets zeros, every codec's :attr:`Round.outcome`
is filled in from which ranks contribute before it is resumed after its first collective,
and :attr:`Round.factor` is the factor the engine expects. :class:`CodecWorld` keeps a
world of ranks' compressors from round to round, counting the rounds and the factor
expected as the engine does.

A test of a compressor, as a user would write it (pytest)::

    import torch
    from distopt.compression.testing import CodecWorld, layout_of

    def test_my_compressor_sums_alike_on_every_rank_and_owes_what_it_left_out():
        world = CodecWorld(MyCompressor, layout_of([(64, 32), (32,)]), world_size=3)
        truth = torch.zeros(world.layout.numel, dtype=torch.float64)
        received = torch.zeros_like(truth)
        for _ in range(5):
            datas = [torch.randn(world.layout.numel) for _ in range(3)]
            truth += sum(d.double() for d in datas)
            world.round(datas)                 # every rank's datas[r] now holds the sum
            received += datas[0].double()      # the same on every rank, bitwise (checked)
        # error feedback: what did not arrive is what the ranks still owe
        assert torch.allclose(truth - received, world.owed(), atol=1e-4)

A compressor that breaks the protocol fails with :class:`ProtocolError` (an
``AssertionError``), naming what the ranks did.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .protocol import AllGather, AllReduce, AllToAll, Codec, Collective, Compressor, Outcome, PackLayout, Round

__all__ = ["layout_of", "factor_of", "Issued", "ProtocolError", "simulate", "mirror", "owed", "CodecWorld"]


class ProtocolError(AssertionError):
    """A codec broke the protocol: the ranks yielded different collectives, or one after ``last=True``,
    or left different values."""


class Issued(NamedTuple):
    """One collective of a simulated round: its kind (``"AllReduce"``, ``"AllGather"``, ``"AllToAll"``) and
    the elements of the tensor each rank sends. Compares equal to the tuple ``(kind, numel)``."""

    kind: str
    numel: int


def layout_of(shapes: Sequence[Sequence[int]], members: Optional[Sequence[int]] = None, *,
              dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> PackLayout:
    """A pack of members of these shapes, one after the other (what the engine tells a compressor).

    Args:
        shapes: each member's shape.
        members: their parameter indices (default: 0, 1, ...).
        dtype: the values' dtype (default: float32).
        device: the values' device (default: the CPU).
    """
    offsets, at = [], 0
    for shape in shapes:
        offsets.append(at)
        at += math.prod(shape)
    members = tuple(range(len(shapes))) if members is None else tuple(members)
    return PackLayout(members=members, names=tuple(f"p{i}" for i in members),
                      shapes=tuple(torch.Size(s) for s in shapes), offsets=tuple(offsets), numel=at,
                      dtype=dtype, device=torch.device(device))


def factor_of(contributing: Sequence[bool]) -> float:
    """What the engine multiplies a round's sum by, from which ranks contribute: ``world / contributors``
    (the mean over the ranks that contributed), or 1 where every rank or none does."""
    count, world = sum(contributing), len(contributing)
    return world / count if 0 < count < world else 1.0


def _describe(collective: Collective) -> tuple:
    out = getattr(collective, "out", None)
    return (type(collective).__name__, collective.tensor.numel(), collective.tensor.dtype,
            None if out is None else (out.numel(), out.dtype), collective.last)


def _check_shape(collective: Collective, world: int) -> None:
    if not isinstance(collective, (AllReduce, AllGather, AllToAll)):
        raise ProtocolError(f"a codec yielded {collective!r}; a codec yields AllReduce, AllGather or AllToAll")
    if isinstance(collective, AllGather) and collective.out.numel() != world * collective.tensor.numel():
        raise ProtocolError(f"AllGather's out holds {collective.out.numel()} elements, not world_size ({world}) "
                            f"times its tensor's {collective.tensor.numel()}")
    if isinstance(collective, AllToAll) and (collective.tensor.numel() % world
                                             or collective.out.numel() != collective.tensor.numel()):
        raise ProtocolError(f"AllToAll's tensor ({collective.tensor.numel()}) and out ({collective.out.numel()}) "
                            f"must be as long, in {world} equal chunks")


def _carry_out(asked: Sequence[Collective]) -> None:
    """Every rank's part of one collective, done in plain torch (in rank order, as a sum would be)."""
    world, first = len(asked), asked[0]
    if isinstance(first, AllReduce):
        total = asked[0].tensor.clone()
        for a in asked[1:]:
            total.add_(a.tensor)
        for a in asked:
            a.tensor.copy_(total)
    elif isinstance(first, AllGather):
        stacked = torch.cat([a.tensor.reshape(-1) for a in asked])
        for a in asked:
            a.out.view(-1).copy_(stacked)
    else:
        chunks = [a.tensor.reshape(world, -1) for a in asked]
        for j, a in enumerate(asked):
            a.out.view(world, -1).copy_(torch.stack([chunks[i][j] for i in range(world)]))


def simulate(codecs: Sequence[Codec], datas: Sequence[Tensor], *, step: int = 0,
             contributing: Optional[Sequence[bool]] = None, exchange: bool = False, factor: float = 1.0,
             identical: bool = True) -> List[Issued]:
    """One round of ``codecs[r]`` on ``datas[r]`` for every rank ``r``, as the engine runs it.

    Each ``datas[r]`` is what the engine hands rank ``r``'s codec (values already scaled by the
    mean's ``1/world``) and holds the sum once the round is over; a rank that does not contribute
    gets zeros, as the engine gives it. Before a codec is resumed after its first collective, its
    :attr:`Round.outcome` says which ranks contributed and the round's factor (:func:`factor_of`).

    Args:
        codecs: one codec per rank, each from its own rank's compressor (rank r's state is its own).
        datas: one flat tensor per rank, ``layout.numel`` long.
        step: :attr:`Round.step`.
        contributing: which ranks contribute (default: all).
        exchange: :attr:`Round.exchange` (a mode's exchange rather than gradients).
        factor: :attr:`Round.factor`, the factor the engine expects (the last round's).
        identical: check that every rank's values end the same, bitwise (default: True).

    Returns:
        The collectives of the round, in order.

    Raises:
        ProtocolError: the ranks yielded different collectives, a rank yielded after a collective
            marked ``last=True`` or ended before the others, or (``identical``) their sums differ.
    """
    world = len(codecs)
    if len(datas) != world:
        raise ValueError(f"simulate() takes one data tensor per codec, got {len(datas)} for {world} codecs")
    contributing = [True] * world if contributing is None else list(contributing)
    rounds = [Round(rank=r, world_size=world, step=step, contributing=contributing[r], exchange=exchange,
                    contributors=world, factor=factor, outcome=Outcome()) for r in range(world)]
    for data, live in zip(datas, contributing):
        if not live:
            data.zero_()  # what Round.contributing=False promises the codec
    gens: List[Iterator[Collective]] = [c.reduce(d, rnd) for c, d, rnd in zip(codecs, datas, rounds)]
    asked = [next(g, None) for g in gens]
    trace: List[Issued] = []
    while True:
        done = [a is None for a in asked]
        if any(done):
            if not all(done):
                raise ProtocolError(f"ranks {[r for r, d in enumerate(done) if d]} ended their round while the "
                                    f"others yielded {_describe(next(a for a in asked if a is not None))}")
            break
        for a in asked:
            _check_shape(a, world)
        kinds = {_describe(a) for a in asked}
        if len(kinds) != 1:
            raise ProtocolError(f"after {trace}, the ranks yielded different collectives: "
                                f"{[_describe(a) for a in asked]} (kind, numel, dtype, out, last) by rank")
        trace.append(Issued(type(asked[0]).__name__, asked[0].tensor.numel()))
        _carry_out(asked)
        for rnd in rounds:  # the flags are back with the first collective
            if rnd.outcome.factor is None:
                rnd.outcome.contributors, rnd.outcome.factor = sum(contributing), factor_of(contributing)
                rnd.outcome.exchange = exchange if any(contributing) and not all(contributing) else None
        last = asked[0].last
        asked = [next(g, None) for g in gens]
        if last and any(a is not None for a in asked):
            raise ProtocolError(f"a codec yielded {[_describe(a) for a in asked]} after a collective it marked "
                                "last=True (the engine raises TypeError); mark only the final collective last")
    if identical:
        for r in range(1, world):
            if not torch.equal(datas[r].reshape(-1).view(torch.uint8), datas[0].reshape(-1).view(torch.uint8)):
                raise ProtocolError(f"rank {r}'s values differ from rank 0's after the round: every rank must "
                                    "leave the same sum, bitwise (add the ranks' parts in rank order)")
    return trace


def mirror(collective: Collective, world_size: int, rank: int = 0) -> None:
    """Carry out one rank's collective alone, as if every one of ``world_size`` ranks had sent what it sent.

    For timing one rank's codec without the others (``bench/codecs.py``): an all-reduce
    multiplies, an all-gather repeats, an all-to-all brings this rank's own chunk from each.
    """
    _check_shape(collective, world_size)
    if isinstance(collective, AllReduce):
        collective.tensor.mul_(world_size)
    elif isinstance(collective, AllGather):
        rows = collective.out.view(world_size, -1)
        rows.copy_(collective.tensor.reshape(1, -1).expand_as(rows))
    else:
        rows = collective.out.view(world_size, -1)
        rows.copy_(collective.tensor.reshape(world_size, -1)[rank].unsqueeze(0).expand_as(rows))


def owed(compressors: Sequence[Compressor], layout: PackLayout, exchange: bool = False) -> Tensor:
    """What the ranks' compressors still owe the sum, laid out as the pack (float64): the sum of their
    residuals (``compressor.residuals[(exchange, member)]``, in applied units), zeros where none is kept.

    For error feedback's invariant: what was meant, less what arrived, is what is owed.
    """
    total = torch.zeros(layout.numel, dtype=torch.float64, device=layout.device)
    for compressor in compressors:
        residuals = getattr(compressor, "residuals", {})
        for index, shape, offset in zip(layout.members, layout.shapes, layout.offsets):
            residual = residuals.get((exchange, index))
            if residual is not None:
                total[offset:offset + shape.numel()] += residual.reshape(-1).to(torch.float64)
    return total


class CodecWorld:
    """``world_size`` ranks, each with its own compressor and its codec for one pack, from round to round.

    Args:
        make: builds one rank's compressor (called once per rank), e.g. the class.
        layout: the pack (:func:`layout_of`).
        world_size: the ranks.

    Attributes:
        compressors: each rank's compressor.
        codecs: each rank's codec for the pack (None where the compressor sends it as it is).
        rounds: the rounds run so far: the next round's :attr:`Round.step`.
    """

    def __init__(self, make: Callable[[], Compressor], layout: PackLayout, world_size: int) -> None:
        self.layout = layout
        self.world_size = world_size
        self.compressors: List[Compressor] = [make() for _ in range(world_size)]
        self.codecs: List[Optional[Codec]] = [c.codec(layout) for c in self.compressors]
        self.rounds = 0
        self._last: Optional[List[bool]] = None  # which ranks contributed to the last round

    def round(self, datas: Sequence[Tensor], contributing: Optional[Sequence[bool]] = None, exchange: bool = False,
              factor: Optional[float] = None) -> List[Issued]:
        """One round (:func:`simulate`): every ``datas[r]`` then holds the sum.

        Args:
            contributing: which ranks contribute (default: all); inside a join block the ranks that
                have joined.
            factor: :attr:`Round.factor`; by default what the engine expects: 1 where every rank
                contributes (outside a join block, or before a rank joins), else the factor of the
                last round (a join block's ranks that have joined stay joined until it ends).

        Raises:
            ProtocolError: as :func:`simulate`; ``ValueError``: a rank's compressor gave no codec.
        """
        if any(c is None for c in self.codecs):
            raise ValueError(f"the compressors sent {self.layout} as it is (codec() answered None): nothing to run")
        live = [True] * self.world_size if contributing is None else list(contributing)
        if factor is None:
            factor = 1.0 if all(live) or self._last is None else factor_of(self._last)
        trace = simulate(self.codecs, datas, step=self.rounds, contributing=live, exchange=exchange,  # type: ignore[arg-type]
                         factor=factor)
        self.rounds += 1
        self._last = live
        return trace

    def owed(self, exchange: bool = False) -> Tensor:
        """What the ranks still owe the sum (:func:`owed`)."""
        return owed(self.compressors, self.layout, exchange)
