"""How a :class:`distopt.DistributedOptimizer` turns local gradients into a step.

A mode is a public object the user passes as ``mode=`` (:class:`Synchronous`, the default;
:class:`ShardedState`; :class:`LocalSGD`; :class:`DiLoCo`; :class:`Islands`, synchronous inside each host and any of the others between hosts), or that the flat keyword
arguments build (:mod:`distopt.modes.shorthands`). It plugs into the wrapper at the seams
documented in :mod:`distopt.modes.base`, and owns its arguments: their checks, the settings
the ranks compare, what it cannot be combined with. Adding a mode is its module here, one
line in :data:`MODES` (and its import), and its tests.
"""
from typing import Tuple, Type

from .base import Mode, ModeContext, OuterFactory
from .diloco import DiLoCo, LocalSGD
from .islands import Islands
from .local_sgd import LocalSGDMode
from .sharded import ShardedState
from .shards import merge_state_dicts
from .shorthands import resolve, settings_of
from .streaming import StreamingMode
from .synchronous import Synchronous

__all__ = ["Mode", "ModeContext", "OuterFactory", "MODES", "Synchronous", "ShardedState", "LocalSGD", "DiLoCo", "Islands",
           "LocalSGDMode", "StreamingMode", "merge_state_dicts", "resolve", "settings_of"]

#: The public modes (each documented with a whole training loop, and checked so by the tests).
MODES: Tuple[Type[Mode], ...] = (
    Synchronous,
    ShardedState,
    LocalSGD,
    DiLoCo,
    Islands,
)
