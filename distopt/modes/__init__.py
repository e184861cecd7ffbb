"""How a :class:`distopt.DistributedOptimizer` turns local gradients into a step.

A mode plugs into the wrapper at two seams, documented in :mod:`distopt.modes.base`:
what happens to gradients at the end of backward, and what happens at ``step()``.
The synchronous mode (average every gradient in backward, then step) is the default;
each further mode is a module of its own here.
"""
from .base import Mode
from .local_sgd import LocalSGDMode
from .sharded import ShardedMode
from .synchronous import SynchronousMode

__all__ = ["Mode", "LocalSGDMode", "ShardedMode", "SynchronousMode"]
