"""The public wrapper: :class:`DistributedOptimizer`, :func:`join`, and the checks on their arguments."""
from .optimizer import DEFAULT_PACK_THRESHOLD, DistributedOptimizer, join
from .rank_state import RankState

__all__ = ["DistributedOptimizer", "join", "DEFAULT_PACK_THRESHOLD", "RankState"]
