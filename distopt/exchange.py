"""Sending values other than gradients through the engine's packs (local SGD's pseudo-gradients).

An exchange is a round like a gradient round: the same packs, the same plan
order, the same control flags. So a rank that has joined shadows it like any
round (:mod:`distopt.joining`), and the contributors' mean is rescaled to count
only them. Only what goes into each pack differs: ``fill`` writes it into the
pack's member views as the pack launches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .rounds import ACTIVE, PHASE_EXCHANGE

if TYPE_CHECKING:
    from .engine import GradientEngine
    from .packs import Pack

__all__ = ["launch_exchange", "finish_exchange"]


def launch_exchange(engine: "GradientEngine", fill: Callable[["Pack"], None]) -> None:
    """Start a round that sends what ``fill`` writes into each pack instead of gradients.

    Args:
        engine: the engine whose packs carry the values.
        fill: called with each pack, in plan order, as it launches; it must apply
            the engine's ``scale`` itself. Finish with :func:`finish_exchange`.
    """
    with engine.lock:
        engine.open_round(PHASE_EXCHANGE)
        engine.exchange_fill = fill
        engine.state = ACTIVE
        if not engine.planned:
            # No backward saw an arrival order: offer the current one, so the plan is
            # fixed once (one broadcast) rather than re-offered at every exchange.
            engine.arrivals = [i for pack in engine.packs for i in pack.spec.members]
        if engine.packs:
            engine.flush()


def finish_exchange(engine: "GradientEngine") -> None:
    """Wait for the exchange :func:`launch_exchange` started; each pack's ``data`` then holds the mean."""
    with engine.lock:
        try:
            if engine.packs:
                engine.finish_round()
            else:  # nothing trainable: only the control flags travel, as a joined rank's shadow does
                engine.control_round()
        finally:
            engine.exchange_fill = None
