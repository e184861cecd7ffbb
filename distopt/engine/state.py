"""The gradient engine's state, in typed parts grouped by lifetime and concern.

:class:`distopt.engine.GradientEngine` is handed its fixed parts at construction, as
torch's ``ZeroRedundancyOptimizer`` groups its overlap state in ``_OverlapInfo``, and
keeps the others itself; nothing outside the engine assigns them (the engine's methods
change them, each named for what it means, e.g. ``enter_join``, ``set_world``):

- :class:`EngineConfig` (fixed for the engine's life): how packs travel, and what the
  channel cannot do (a fault-tolerant one only all-reduces);
- :class:`World` (for the engine's life, resized only under fault tolerance, where each
  step's quorum decides it): how many ranks a round is averaged over. It is the one
  place ``world_size`` lives: the wrapper and the mode's context ask it;
- :class:`JoinState` (a join block): whether this rank is in one, and has joined;
- :class:`RoundOutcome` (from one round back to the next): what the last round's control
  flags said, on every rank alike;
- :class:`Announcements` (one round): what this rank's next flags say beyond its gradients;
- :class:`ExchangeState` (the mode's life): a mode's values sent through the packs
  instead of gradients (local SGD), and the fragments of streaming local SGD;
- :class:`RoundHooks` (construction): fault tolerance's say at a round's open and end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Protocol

from ..compression.protocol import Compressor
from .packs import Pack
from .in_flight import GATHER_SUM_MAX_BYTES

__all__ = ["EngineConfig", "World", "JoinState", "RoundOutcome", "Announcements", "ExchangeState", "RoundHooks"]


@dataclass(frozen=True)
class EngineConfig:
    """How an engine's packs travel; fixed once its parameters are tracked.

    Attributes:
        op: the all-reduce op (``dist.ReduceOp.SUM``, or ``AVG`` where the backend averages natively).
        pack_threshold: bytes at which a pack closes.
        mean: gradients are averaged (not summed) over the ranks.
        scale_mean: the mean's 1/world is applied while each value is copied into its pack (no
            extra pass; always before a 16-bit cast, which could overflow), rather than by ``op``.
        compressor: how float packs travel (:mod:`distopt.compression`), or None: as they are.
        sparse_as_dense: densify sparse gradients instead of raising.
        root_rank: the rank (in the channel) whose observed gradient order becomes the plan.
        gather_sum_limit: bytes a rank may receive for a small sum to travel as a gather
            (:func:`distopt.engine.in_flight.sums_by_gather`); 0: never (a channel that only all-reduces).
        rows: a large gradient of mostly zero rows may travel as its rows (a gather).
        flags_from_all: every rank of the world sends control flags (not under fault tolerance,
            where a healing replica sends none: see :meth:`distopt.planning.control.Totals.check`).
        fixed_plan: the plan stays the registration order (no root to broadcast another).
    """

    op: Any
    pack_threshold: int
    mean: bool = True
    scale_mean: bool = False
    compressor: Optional[Compressor] = None
    sparse_as_dense: bool = False
    root_rank: int = 0
    gather_sum_limit: int = GATHER_SUM_MAX_BYTES
    rows: bool = True
    flags_from_all: bool = True
    fixed_plan: bool = False


@dataclass
class World:
    """How many ranks an engine's rounds are averaged over: its channel's size, or under fault
    tolerance the replicas of this step's quorum (:meth:`distopt.engine.GradientEngine.set_world`).

    One object per engine, shared by reference with whoever needs the count (the wrapper, the
    mode's context), so that it lives in one place.
    """

    size: int = 1


@dataclass
class JoinState:
    """This rank in a join block (:mod:`distopt.wrapper.join`).

    Attributes:
        in_block: inside ``join()``: its flags say so, and the mean is rescaled to the contributors.
        divide_by_world: joined ranks count as zeros in the mean (``join(divide_by_world=True)``).
        joined: this rank ran out of data and sends zeros in shadow rounds.
        shadowed: the fragment the last shadow round sent (None: every pack).
        probed: the last shadow round was a probe of the ranks still training (``check_drift()``), which
            takes no place among the rounds: the next shadow round sends the same packs again.
    """

    in_block: bool = False
    divide_by_world: bool = False
    joined: bool = False
    shadowed: Optional[int] = None
    probed: bool = False


@dataclass
class RoundOutcome:
    """What the control flags of the last round back said (every rank reads the same).

    Attributes:
        contributors: ranks that contributed to the last round with contributors (0: none did).
        training: of those, the ranks that go on training (:attr:`distopt.planning.control.Totals.training`).
        contributed_last: this rank contributed to the last round that had contributors.
        closure: the last round was a closure's: a reduction of its loss follows, on every rank.
        probe: the last round back was a probe of the ranks still training (``check_drift()`` inside a join
            block), shadowed by this rank: nothing follows it, and the other fields are those of the round before.
    """

    contributors: int = 1
    training: int = 1
    contributed_last: bool = True
    closure: bool = False
    probe: bool = False


@dataclass
class Announcements:
    """What this rank's control flags say in the rounds it sends now, beyond its gradients.

    Attributes:
        closure: a closure's round (``step(closure)``): the reduction of its loss follows it.
        leaving: this rank's last contributions before it joins (local SGD's steps not averaged
            yet), so that the others learn from them that it has joined.
    """

    closure: bool = False
    leaving: bool = False


@dataclass
class ExchangeState:
    """A mode's values sent through the packs instead of gradients.

    Attributes:
        local: gradients stay local (local SGD): backward passes never reduce.
        fill: while an exchange launches: writes what to send into a pack, instead of its gradients.
        fragments: streaming local SGD cuts the parameters into this many fragments
            (:mod:`distopt.planning.fragments`), each kept in packs of its own.
        fragment_packs: ``fragment_packs[f]`` lists fragment ``f``'s packs, in plan order.
        shadow_fragment: asked before each shadow round of a rank that has joined: which
            fragment the others send (None: every pack: a gradient round, or a whole-model exchange).
    """

    local: bool = False
    fill: Optional[Callable[[Pack], None]] = None
    fragments: int = 1
    fragment_packs: List[List[int]] = field(default_factory=list)
    shadow_fragment: Optional[Callable[[], Optional[int]]] = None


class RoundHooks(Protocol):
    """Fault tolerance's say in an engine's rounds, given at construction.

    :class:`distopt.fault_tolerance.FaultTolerance` is one.
    """

    #: False while this replica heals: it sends zeros, and its codecs add nothing of their own state.
    participating: bool
    #: The step count the quorum agrees on (a codec's ``Round.step``: a healing replica's own count
    #: is not yet its peers').
    quorum_step: int

    def enter_round(self) -> None:
        """A round that sends opens (before anything is scaled into a pack): wait for the step's
        quorum, which sets the engine's world (:meth:`distopt.engine.GradientEngine.set_world`)."""

    def round_failed(self) -> bool:
        """Asked once a round's collectives are back: True when one failed because a replica went
        away. The step is then discarded: nothing is read back."""
