"""Pure value types and planning: no process group, no communication.

- :mod:`~distopt.planning.packing`: which parameters share a pack, and the order packs launch in;
- :mod:`~distopt.planning.replanning`: the plan after the ranks observed an order or unfroze parameters;
- :mod:`~distopt.planning.ownership`: which rank keeps which parameter's state (``shard_state``);
- :mod:`~distopt.planning.control`: the control flags every pack carries, and what their sums mean;
- :mod:`~distopt.planning.stats`: :class:`StepStats`, what a round did;
- :mod:`~distopt.planning.drift`: the drift check's exact fingerprints, and what a difference between ranks means;
- :mod:`~distopt.planning.fragments`, :mod:`~distopt.planning.schedule`, :mod:`~distopt.planning.mixing`:
  streaming local SGD's fragments, its staggered schedule, and its merge.

Everything here is tested without a process (``tests/unit``).
"""
from .stats import StepStats

__all__ = ["StepStats"]
