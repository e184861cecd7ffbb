"""How a :class:`distopt.DistributedOptimizer` turns local gradients into a step.

A mode plugs into the wrapper at two seams, documented in :mod:`distopt.modes.base`:
what happens to gradients at the end of backward, and what happens at ``step()``.
Each mode is a module of its own here, and one line in :data:`REGISTRY`: the
wrapper builds the first mode whose :meth:`~distopt.modes.base.Mode.from_arguments`
accepts its arguments, so the default (synchronous) mode comes last.
"""
from typing import Tuple, Type

from .base import Mode, ModeArguments, ModeContext, OuterFactory
from .local_sgd import LocalSGDMode
from .sharded import ShardedMode
from .streaming import StreamingMode
from .shards import merge_state_dicts
from .synchronous import SynchronousMode

__all__ = ["Mode", "ModeArguments", "ModeContext", "OuterFactory", "REGISTRY", "choose",
           "LocalSGDMode", "StreamingMode", "ShardedMode", "SynchronousMode", "merge_state_dicts"]

#: The modes, asked in this order.
REGISTRY: Tuple[Type[Mode], ...] = (
    StreamingMode,
    LocalSGDMode,
    ShardedMode,
    SynchronousMode,
)


def choose(args: ModeArguments) -> Mode:
    """The first registered mode that accepts ``args``.

    Raises:
        ValueError: no registered mode accepts them.
    """
    for cls in REGISTRY:
        mode = cls.from_arguments(args)
        if mode is not None:
            return mode
    raise ValueError(f"no mode accepts {args}; register a default mode last in distopt.modes.REGISTRY")
