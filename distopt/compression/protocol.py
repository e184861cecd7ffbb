"""The compressor protocol: how a pack of gradients may travel in fewer bytes.

A :class:`Compressor` is handed each pack of the plan once, as a :class:`PackLayout`,
and answers with a :class:`Codec` for it, or None to send that pack as it is. A
codec averages the pack's values by *yielding* the collectives it needs
(:class:`AllReduce`, :class:`AllGather`, :class:`AllToAll`) and computing between
them; the engine issues each one and resumes the codec once it is back.

The engine, not the codec, decides when a collective is issued: every pack's first
collective as the pack launches (during backward, in the plan's order), each later
one in the engine's one waiting place, pack after pack in the plan's order. So every
rank issues the same collectives in the same order whatever its timing: the reason
DDP's PowerSGD hook, whose futures chain its second collective from another thread,
can abort on gloo with "collective mismatch", and a codec cannot.

A codec marks the collective after which it yields no more (``last=True``): the
engine then need not resume it to learn that, so an exchange that outlives a step
(streaming local SGD's) travels until its values are wanted rather than being waited
for at the next point where later stages are issued.

A codec sees the pack's values already multiplied by the mean's ``1/world`` and
leaves their *sum* over the ranks in place. The pack's control flags never pass
through it: the engine sums them exactly, in a small collective of their own, or in
front of each rank's part of the codec's first collective where that is an all-gather
(the codec's tensors are copied in and out, and it sees only them).

Once the round is back the engine multiplies the sum by the round's *factor*:
``world / contributors`` where ranks have joined (``join()``: the mean is over the ranks
that contributed), else 1. Which ranks contribute is known only from the round's flags,
but those are back before a codec is resumed after its first collective: the engine then
fills in :attr:`Round.outcome`, so the codec knows the round's contributors and factor
before its later stages, and before it settles what it keeps for the next round.

**Error feedback across a change of contributors.** A codec that keeps what it left out
(a *residual*, added to its next values) keeps it in *applied units*: what it amounts to
once the engine's factor is applied. Before its first collective it adds
``residual / round.factor`` (the factor expected, as the last round's flags said) to its
values ``x``; once ``outcome`` is known, with ``f = round.final_factor`` and ``v`` what
this rank sent of ``x + residual / round.factor``, the residual becomes
``round.factor * (x + residual / round.factor - v) + (f - round.factor) * (x - v)``,
that is the old residual plus ``f * (x - v)``. So every value left out is applied exactly
once, at the factor of the round that left it out, however the contributors change
before it is sent (a rank joins, a join block ends). The two factors differ only in the
round in which a rank joins; outside join blocks both are 1 and nothing is rescaled.

Example of a compressor a user might write (values sent as bfloat16 with error feedback
would follow the same shape)::

    class Halves(Compressor):
        def codec(self, layout):
            return _HalvesCodec() if layout.dtype == torch.float32 else None

    class _HalvesCodec(Codec):
        def reduce(self, data, round):
            wire = data.to(torch.float16)
            yield AllReduce(wire, last=True)
            data.copy_(wire)
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["PackLayout", "Outcome", "Round", "AllReduce", "AllGather", "AllToAll", "Collective", "Codec", "Compressor"]


@dataclass(frozen=True)
class PackLayout:
    """What a compressor knows of a pack: its members and where each lies in the flat values.

    Attributes:
        members: the members' indices among the wrapper's parameters, stable for its life;
            per-parameter state (a residual, PowerSGD's Q) is keyed by them.
        names: the members' names, for errors.
        shapes: the members' shapes.
        offsets: where each member starts in the pack's flat values.
        numel: elements in the pack's values.
        dtype: the values' dtype.
        device: the values' device.
    """

    members: Tuple[int, ...]
    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]
    offsets: Tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class Outcome:
    """What a round's control flags say, for its codecs (see the module).

    The engine fills it in once the flags are back: before a codec is resumed after its
    first collective. None until then (and where no engine fills it in).

    Attributes:
        contributors: ranks whose values the sum holds (the others have joined and sent zeros).
        factor: what the engine multiplies the sum by: ``world / contributors`` for the mean
            over the ranks that contributed, else 1.
        exchange: whether the contributors' values are a mode's exchange; filled in where a rank
            has joined, which cannot tell before (its :attr:`Round.exchange` is a guess), else None.
    """

    contributors: Optional[int] = None
    factor: Optional[float] = None
    exchange: Optional[bool] = None


@dataclass(frozen=True)
class Round:
    """What a codec knows of the round it reduces in.

    Attributes:
        rank: this rank within the group the collectives span.
        world_size: ranks in that group (every one of them issues every collective).
        step: the rounds this wrapper sent before this one. Every rank's n-th round pairs
            with every other rank's n-th, so it is the same on every rank, one that has
            joined included (it shadows the others' rounds). It counts the optimizer steps
            in synchronous training (and each call of a closure, and a step ``GradScaler``
            skipped), the syncs in local SGD (after ``local_warmup``'s steps), each
            fragment's sync in streaming local SGD. Under fault tolerance: the committed
            steps the quorum agrees on, so that a replica that heals in this round issues
            the same collectives (in local SGD, the syncs).
        contributing: False on a rank that has joined (``join()``), or on a replica that
            heals under fault tolerance: its values are zeros, and it must add nothing of
            its own state (error feedback) to the sum. It still issues every collective,
            and its part of any later stage (e.g. its chunk of a sum) as any rank does.
        exchange: the values are a mode's exchange (local SGD's pseudo-gradients), not
            gradients; state such as residuals is kept apart for the two.
        contributors: ranks whose values the sum is meant to hold, as known before the
            round: the mean's count (``world_size``, but under fault tolerance the replicas
            taking part, without those that heal). None: ``world_size``. Ranks that join
            are learned from the round's flags: :attr:`final_contributors`.
        factor: what the engine expects to multiply the sum by (the last round's, as its
            flags said); the round's own is :attr:`final_factor`, which differs only in
            the round in which a rank joins.
        outcome: the round's contributors and factor, from its flags, once they are back.
    """

    rank: int
    world_size: int
    step: int
    contributing: bool = True
    exchange: bool = False
    contributors: Optional[int] = None
    factor: float = 1.0
    outcome: Outcome = field(default_factory=Outcome, compare=False)

    @property
    def final_contributors(self) -> int:
        """The ranks whose values the sum holds: from the flags once they are back, else as expected."""
        if self.outcome.contributors is not None:
            return self.outcome.contributors
        return self.contributors if self.contributors is not None else self.world_size

    @property
    def final_factor(self) -> float:
        """What the engine multiplies the sum by: from the flags once they are back, else as expected."""
        return self.outcome.factor if self.outcome.factor is not None else self.factor


@dataclass
class AllReduce:
    """Sum ``tensor`` over the ranks, in place."""

    tensor: Tensor
    last: bool = False  # the codec yields nothing after this one (see the module)


@dataclass
class AllGather:
    """Every rank's ``tensor``, in rank order, into ``out`` (``world_size * tensor.numel()`` elements)."""

    tensor: Tensor
    out: Tensor
    last: bool = False  # the codec yields nothing after this one (see the module)


@dataclass
class AllToAll:
    """Chunk ``j`` of ``tensor`` goes to rank ``j``; chunk ``i`` of ``out`` comes from rank ``i`` (equal chunks)."""

    tensor: Tensor
    out: Tensor
    last: bool = False  # the codec yields nothing after this one (see the module)


Collective = Union[AllReduce, AllGather, AllToAll]


class Codec(abc.ABC):
    """Sums one pack's values over the ranks, through the collectives it yields."""

    @abc.abstractmethod
    def reduce(self, data: Tensor, round: Round) -> Iterator[Collective]:
        """Leave the sum of every rank's ``data`` in ``data``, yielding each collective it needs.

        Every rank must yield the same collectives, of the same sizes, in the same
        order: decide them from the layout and the round, never from the values. Mark
        the last one ``last=True`` where it is known to be (nothing breaks without it:
        the engine then resumes the codec to find out, which may mean an earlier wait).

        Args:
            data: the pack's flat values (already scaled by the mean's ``1/world``).
            round: the round's rank, world size, step and kind; its :attr:`Round.outcome`
                is filled in before the codec is resumed after its first collective.

        Yields:
            The next collective; the generator resumes once it is complete.
        """


class Compressor(abc.ABC):
    """Decides how each pack travels; pass one as ``DistributedOptimizer(..., compression=)``.

    One compressor serves one wrapper: it may keep per-parameter state (error feedback)
    that goes into the wrapper's ``state_dict()``.
    """

    #: What ``compression=`` names it (``"powersgd"``, ``"int8"``, ...), for messages.
    name: str = "custom"
    #: Keys of :meth:`state_dict` that hold this rank's own state (error feedback's residuals),
    #: rather than state that is the same on every rank (PowerSGD's warm-started ``Q``). Under
    #: fault tolerance a replica that heals from a live peer starts these empty instead of
    #: taking the peer's: a residual is what one replica still owes the sum, and a copy would
    #: be paid twice (docs/fault-tolerance.md).
    per_rank_keys: Tuple[str, ...] = ()

    @abc.abstractmethod
    def codec(self, layout: PackLayout) -> Optional[Codec]:
        """The codec for a pack, or None to send it uncompressed (e.g. integer packs)."""

    def settings(self) -> Dict[str, Any]:
        """What must match on every rank (compared when the wrapper is built)."""
        return {"compressor": type(self).__qualname__}

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        """About what share of the bytes of gradients of these shapes this compressor sends
        (``pack_threshold="auto"`` sizes packs by it); the default, 1.0, assumes no saving."""
        return 1.0

    def wire_dtype(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        """For a plain cast: the dtype packs of ``dtype`` travel as, which the engine casts inline.

        A compressor that answers a dtype here is never asked for codecs; the default, None,
        means the compressor works through :meth:`codec`.
        """
        return None

    def state_dict(self) -> Dict[str, Any]:
        """This rank's compressor state (residuals, warm-start factors), for checkpoints."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state_dict:
            raise ValueError(f"{type(self).__name__} keeps no state, but was given {sorted(state_dict)}")
