"""How a :class:`distopt.DistributedOptimizer` runs on :class:`~distopt.fault_tolerance.FaultTolerance`.

Two pieces of glue: the gradient engine over the torchft Manager (:func:`open_engine`),
told at construction what the manager's group cannot do and handed the controller as its
:class:`~distopt.engine.state.RoundHooks`; and the end of a step (:func:`commit_or_discard`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from ..engine import GradientEngine
from ..engine.state import EngineConfig, World
from .controller import FaultTolerance

__all__ = ["open_engine", "commit_or_discard"]


def open_engine(fault_tolerance: FaultTolerance, *, world: World, reduce_op: str, pack_threshold: int,
                compressor: Any, sparse_as_dense: bool, backward_passes_per_step: int) -> GradientEngine:
    """The engine over the torchft Manager: all-reduces only, averaged by the manager over the replicas
    taking part in each step (a healing replica sends zeros and no control flag).

    Args:
        fault_tolerance: the controller; it opens every round (its quorum sets ``world``), and says
            whether the round's collectives failed.
        world: the wrapper's :class:`World`, resized by each step's quorum.
        reduce_op: ``"mean"`` or ``"sum"``.
        pack_threshold: bytes at which a pack closes.
        compressor: how float packs travel, or None.
        sparse_as_dense: densify sparse gradients instead of raising.
        backward_passes_per_step: passes accumulated before the reducing one.
    """
    mean = reduce_op == "mean"
    # Sums, scaled by 1/participants while copied into the packs (the world is set per step, when
    # the round opens and the quorum is known), as without fault tolerance.
    config = EngineConfig(
        op=dist.ReduceOp.SUM, pack_threshold=pack_threshold, mean=mean, scale_mean=mean, compressor=compressor,
        sparse_as_dense=sparse_as_dense, root_rank=0,
        gather_sum_limit=0,  # small sums as broadcasts: the manager only all-reduces
        rows=False,  # rows as gathers: likewise
        flags_from_all=False,  # a healing replica sends no flags; torchft's count may include it
        fixed_plan=True,  # the plan stays the registration order: no root to broadcast another
    )
    engine = GradientEngine(channel=fault_tolerance.channel(), config=config,  # type: ignore[arg-type]
                            world=world, backward_passes_per_step=backward_passes_per_step,
                            round_hooks=fault_tolerance)
    fault_tolerance.attach(engine.set_world)
    return engine


def commit_or_discard(fault_tolerance: FaultTolerance, engine: GradientEngine,
                      reduce_for_step: Optional[Callable[[], None]], closure: Optional[Callable[[], Any]]) -> bool:
    """Finish the step's round, then torchft's vote. False: the step is discarded (the round starts over).

    Args:
        fault_tolerance: the controller.
        engine: the wrapper's engine.
        reduce_for_step: reduces what backward did not, where the mode reduces in backward; else None.
        closure: the user's closure, which is refused.

    Raises:
        RuntimeError: a closure (each closure call would need a quorum of its own).
    """
    if closure is not None:
        raise RuntimeError("step(closure) is not supported with fault_tolerance (torchft's optimizer wrapper "
                           "refuses closures too): each closure call would need a quorum of its own")
    if reduce_for_step is not None:
        reduce_for_step()
    if fault_tolerance.commit():
        return True
    engine.reset_round()
    return False
