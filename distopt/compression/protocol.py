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

**Non-finite values.** A non-finite value in any rank's ``data`` (an AMP overflow) must
reach the sum on every rank as non-finite, as an uncompressed all-reduce carries it, so
that ``GradScaler`` skips the step on every rank alike: a codec never clamps or drops it.
State built from such a round (a residual, PowerSGD's ``Q``) is poisoned: a codec drops it,
deciding so from bytes every rank holds alike (the gathered scales, the summed factors), so
every rank drops alike and the next rounds are clean.

**When each method is called** (each method's docstring says what it may assume and must do):

* :meth:`Compressor.wire_dtype`, then :meth:`Compressor.codec`: once per pack, each time the
  engine plans its packs (when it takes parameters on, when it fixes the plan from the
  root's observed gradient order after the first round, when parameters are unfrozen or
  the fragments change). A re-plan happens between rounds; the old plan's codecs get no
  further rounds. After an unfreeze the round is sent again, in the new plan.
* :meth:`Codec.reduce`: once per round that sends its pack, on every rank of the group,
  one reduction at a time; the engine drives it to its end, or closes it (fault tolerance
  closes the codecs of a round that failed: its state is then put back).
* :meth:`Compressor.state_dict`: between rounds, by the wrapper's ``state_dict()`` (after it
  has waited for an exchange in flight), and under fault tolerance before every round (the
  copy that a discarded step puts back) and for a replica that heals from this one.
* :meth:`Compressor.load_state_dict`: between rounds, while the codecs stay live (they
  serve the next round): by the wrapper's ``load_state_dict()``, and under fault tolerance
  after a discarded step or a heal.
* :meth:`Compressor.settings` and :meth:`Compressor.wire_fraction`: when the wrapper takes
  parameters on (the ranks' agreement check, ``pack_threshold="auto"``).

The residual helpers that the built-in compressors use (:class:`~distopt.compression.feedback.PackResiduals`,
:func:`~distopt.compression.feedback.keyed_state`, ...) are public, in
:mod:`distopt.compression.feedback`, and :mod:`distopt.compression.testing` runs a
compressor's codecs for several simulated ranks in one process, for its tests.

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
    """Sums one pack's values over the ranks, through the collectives it yields.

    A codec is made by :meth:`Compressor.codec` for one pack of one plan, and serves every
    round of that plan; it may keep buffers from one round to the next (they are
    allocated once), but state that a checkpoint holds belongs to its compressor (see
    :meth:`Compressor.load_state_dict`).
    """

    @abc.abstractmethod
    def reduce(self, data: Tensor, round: Round) -> Iterator[Collective]:
        """Leave the sum of every rank's ``data`` in ``data``, yielding each collective it needs.

        **Called** once per round that sends this pack, on every rank of the group (a rank
        that has joined included), one reduction at a time: the next call comes after this
        generator has ended or been closed. The engine runs the generator up to its first
        collective as the pack launches and issues it; it resumes the generator once that
        collective is back, in its one waiting place, pack after pack in the plan's order.
        It may close the generator at a yield (fault tolerance, a round that failed:
        ``GeneratorExit`` is raised there); the compressor's state is then put back from
        :meth:`Compressor.state_dict`'s copy, so a codec need not undo anything.

        **It may assume** that ``data`` is the pack's flat, contiguous values
        (``layout.numel`` elements of ``layout.dtype`` on ``layout.device``), already
        multiplied by the mean's ``1/world``; that it is all zeros where
        ``round.contributing`` is False; that ``round.outcome`` is filled in before the
        generator is resumed after its first collective (:class:`Round`); and that a
        collective's tensors are its own again, holding the result, once it is resumed.

        **It must**

        * yield the same collectives on every rank, of the same kinds, sizes and dtypes, in
          the same order, with the same ``last``: decide them from the layout and the round
          (rank, world size, step, contributing, exchange, factor), never from the values.
          The collectives are paired by their order, so a mismatch hangs or aborts;
        * leave in ``data`` the same values on every rank, bitwise (sum in rank order where
          it adds the ranks' parts itself), as the ranks' parameters must stay identical;
        * on a rank that does not contribute, add nothing of its own state to the sum (its
          values are zeros) and still yield every collective, with its part of any later
          stage (e.g. its chunk of a sum) as any rank does;
        * carry a non-finite value of any rank into every rank's sum, and drop the state that
          such a round poisoned (see the module);
        * keep the tensors it yields alive and untouched until it is resumed.

        It need not mark its last collective ``last=True``, but should where it is known to
        be: the engine then need not resume it to learn that, so an exchange that outlives a
        step travels until it is wanted. Yielding after a collective marked last raises
        ``TypeError`` in the engine.

        Args:
            data: the pack's flat values (already scaled by the mean's ``1/world``).
            round: the round's rank, world size, step and kind; its :attr:`Round.outcome`
                is filled in before the codec is resumed after its first collective.

        Yields:
            :class:`AllReduce`, :class:`AllGather` or :class:`AllToAll`; the generator
            resumes once it is complete.
        """


class Compressor(abc.ABC):
    """Decides how each pack travels; pass one as ``DistributedOptimizer(..., compression=)``.

    One compressor serves one wrapper (a second live wrapper is refused): it may keep
    per-parameter state (error feedback) that goes into the wrapper's ``state_dict()``.
    Per-parameter state is keyed by :attr:`PackLayout.members`, which stay the same
    across re-plans, so a new plan's codecs take over what the old plan's left.
    """

    #: What ``compression=`` names it (``"powersgd"``, ``"int8"``, ...), for messages.
    name: str = "custom"
    #: Keys of :meth:`state_dict` that hold this rank's own state (error feedback's residuals),
    #: rather than state that is the same on every rank (PowerSGD's warm-started ``Q``). Under
    #: fault tolerance a replica that heals from a live peer starts these empty instead of
    #: taking the peer's: a residual is what one replica still owes the sum, and a copy would
    #: be paid twice (docs/fault-tolerance.md). A compressor with error feedback lists the key
    #: its residuals are under; the default, none, suits one without state.
    per_rank_keys: Tuple[str, ...] = ()

    @abc.abstractmethod
    def codec(self, layout: PackLayout) -> Optional[Codec]:
        """The codec for a pack, or None to send it uncompressed (e.g. integer packs).

        **Called** once per pack each time the engine plans its packs (see the module), on
        every rank, and only where :meth:`wire_dtype` answered None for the pack's dtype.
        It must answer alike on every rank (a codec on one rank and None on another would
        pair different collectives): decide from the layout only. It may assume nothing of
        earlier plans' codecs, which are dropped; state it keeps per parameter lives on the
        compressor, keyed by ``layout.members``.
        """

    def settings(self) -> Dict[str, Any]:
        """What must match on every rank: every argument that changes the collectives or the values.

        **Called** when the wrapper takes parameters on, on every rank; ranks whose settings differ get the
        same ``ValueError`` on every rank, naming ``compression`` and both values. Plain values
        only (they are compared after a round trip through pickle).
        """
        return {"compressor": type(self).__qualname__}

    def wire_fraction(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> float:
        """About what share of the bytes of gradients of these shapes this compressor sends.

        **Called** when the wrapper takes parameters on with ``pack_threshold="auto"``, which sizes packs
        by it (a compressor that sends less gets larger packs). Only an estimate, in (0, 1];
        the default, 1.0, assumes no saving.
        """
        return 1.0

    def wire_dtype(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        """For a plain cast: the dtype packs of ``dtype`` travel as, which the engine casts inline.

        **Called** once per pack when the engine plans its packs, before :meth:`codec`. A
        dtype here means the engine casts the pack's values (already scaled by ``1/world``)
        to it, all-reduces them and casts back, and :meth:`codec` is not asked for that
        pack; the default, None, means the compressor works through :meth:`codec`.
        """
        return None

    def casts_only(self) -> bool:
        """Whether this compressor sends every pack as a plain cast (:meth:`wire_dtype`) or as it is, and
        never through a codec.

        **Called** when a wrapper with ``shard_state="gradients"`` is built, which reduce-scatters each pack
        to the owners of its members: a cast chunk can travel to its owner alone, while a codec's
        collectives (and its error-feedback residuals) assume the whole pack on every rank. The default,
        False, suits any compressor with a codec.
        """
        return False

    def state_dict(self) -> Dict[str, Any]:
        """This rank's compressor state (residuals, warm-start factors), for checkpoints.

        **Called** between rounds: by the wrapper's ``state_dict()``, and under fault
        tolerance before every round and for a replica that heals (see the module).

        Returns:
            Copies, never the live tensors: the codecs go on changing their state in place,
            and fault tolerance keeps this dict to put it back after a discarded step.
            :func:`distopt.compression.feedback.keyed_state` makes such copies, under text
            keys. Tensors, plain values, and dicts of them (it is saved with ``torch.save``).
        """
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (its own dict, or a copy of it from another rank).

        **Called** between rounds while the codecs stay live: they serve the next round,
        so a codec that keeps views of the state (a residual buffer) must notice the load
        and take the loaded values, e.g. through a counter of loads that it compares at each
        round (``loads``, read by :class:`distopt.compression.feedback.PackResiduals`). Under
        fault tolerance a replica that heals is given a dict without :attr:`per_rank_keys`:
        it then starts those empty. It must take copies of what it is given (the caller
        keeps the dict, e.g. a checkpoint it loads into several wrappers):
        :func:`distopt.compression.feedback.load_keyed_state` makes them.

        Raises:
            ValueError: a key this compressor does not keep (a state dict of another compressor).
        """
        if state_dict:
            raise ValueError(f"{type(self).__name__} keeps no state, but was given {sorted(state_dict)}")
