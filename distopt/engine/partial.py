"""An exchange of some of the plan's packs that stays in flight across steps (streaming local SGD).

Streaming local SGD (:mod:`distopt.modes.streaming`) sends one fragment of the
model at a time and lets it travel while the next ``sync_overlap`` inner steps
run. Such an exchange is not the engine's round: a round ends at every
``step()`` (``reset_round``), and the exchange must outlive it. So its
collectives are kept here, by the mode that launched it, rather than in the
engine's ``inflight`` list, and the engine completes them when asked
(:meth:`distopt.engine.GradientEngine.arrive_partial`).

The record also keeps, for each pack, the tensors it sent: a pack of one large
parameter sends a tensor of its own at each launch (``packs.scratch``), and the
engine lets go of it at the end of every round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from torch import Tensor

from ..planning.control import Totals
from .packs import Pack
from .in_flight import Sent

__all__ = ["PartialExchange", "empty_exchange"]


@dataclass
class PartialExchange:
    """The packs of one fragment's exchange, in flight or back.

    Attributes:
        packs: the packs' places in the plan when it was launched.
        sent: its collectives, until they are back.
        held: each pack with the flat data and the member views it sent (the mean, once back).
        arrived: every collective is back and the values are the mean over the contributors.
        totals: the control flags read back (None before, or when no pack carried flags).
        settled: the flags were acted on (the checks, a re-plan), as on every rank at one point.

    Example::

        exchange = engine.launch_partial(engine.exchange.fragment_packs[f], fill)   # inner steps run meanwhile
        engine.finish_partial(exchange)
        for param, mean in exchange.values():
            ...
    """

    packs: List[int]
    sent: List[Sent]
    held: List[Tuple[Pack, Tensor, List[Tensor]]]
    arrived: bool = False
    totals: Optional[Totals] = None
    settled: bool = False

    def values(self) -> List[Tuple[Tensor, Tensor]]:
        """``(parameter, value)`` for every member, in plan order: the mean once arrived."""
        return [(p, view) for pack, _, views in self.held for p, view in zip(pack.params, views)]

    def staged(self) -> bool:
        """Whether a codec of it may still issue collectives (a compressor's later stages)."""
        return any(sent.staged for sent in self.sent)

    def nbytes(self) -> int:
        """Bytes of the values it carries (not counting flags)."""
        return sum(data.numel() * data.element_size() for _, data, _ in self.held)


def empty_exchange() -> PartialExchange:
    """An exchange with nothing to send (no pack): back at once."""
    return PartialExchange([], [], [], arrived=True, settled=True, totals=None)

