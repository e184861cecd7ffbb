"""The reduction engine: gradient hooks, persistent pack buffers, and the round that reduces them.

:class:`~distopt.engine.engine.GradientEngine` is the whole hot path; a pack's buffers
are :mod:`~distopt.engine.packs`, what is in flight :mod:`~distopt.engine.in_flight`, and
a gradient that travels as its non-zero rows :mod:`~distopt.engine.sparse_rows`. The engine's
state is grouped in typed parts (:mod:`~distopt.engine.state`), and
:func:`~distopt.engine.opening.open_engine` opens one over a process group.
"""
from .engine import BACKWARD_PATIENCE, GradientEngine, Phase, RoundState

__all__ = ["GradientEngine", "RoundState", "Phase", "BACKWARD_PATIENCE"]
