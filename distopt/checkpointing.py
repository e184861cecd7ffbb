"""Checkpoints and shared state of :class:`distopt.DistributedOptimizer`: state dicts, shards, broadcasts.

A mixin of the public class: saving and loading go through the mode (a sharded
wrapper gathers its shards, local SGD adds its own state), and the broadcasts
give every rank the root's parameters or optimizer state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from . import collectives, stalls
from .modes import Mode, ShardedMode, shards

if TYPE_CHECKING:
    from .engine import GradientEngine

__all__ = ["StateSurface"]


class StateSurface:
    """State dicts and broadcasts; the attributes it reads are the wrapper's."""

    optimizer: Optimizer
    shard_state: bool
    world_size: int
    root_rank: int
    param_groups: List[Dict[str, Any]]
    _mode: Mode
    _engine: "GradientEngine"
    _params: List[Tensor]

    def _check_not_retired(self, what: str) -> None:
        raise NotImplementedError

    def _group(self) -> Optional[ProcessGroup]:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict; loads into a plain optimizer and back.

        With ``shard_state=True`` it is gathered from every rank's shard, so every
        rank must call it; it is the same dict an unsharded optimizer would give.
        Local SGD adds its own state (step count, last-sync parameters, outer
        optimizer state) under the key ``"distopt_local_sgd"``, which a plain
        ``torch.optim`` optimizer's ``load_state_dict`` ignores.
        """
        return self._mode.state_dict(self)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """With ``shard_state=True``: this rank's shard only, without communication (fast saves of
        large models: one file per rank); :func:`distopt.merge_state_dicts` rebuilds the full dict.

        In a world of one it is the only shard, the whole state, so a script that saves one
        file per rank runs unchanged.

        Raises:
            RuntimeError: the wrapper does not shard its state.
        """
        if isinstance(self._mode, ShardedMode):
            return self._mode.sharded_state_dict(self)
        if not self.shard_state:
            raise RuntimeError("sharded_state_dict() needs shard_state=True; use state_dict()")
        return shards.shard_of(self.optimizer, 0, 1, [0] * sum(len(g["params"]) for g in self.param_groups))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this wrapper or a plain optimizer (with ``shard_state``, from any world size).

        A shard from :meth:`sharded_state_dict` loads as it is into the same rank of a sharded
        wrapper with the same world size and owners, and anywhere if it was saved at world size 1.

        Raises:
            ValueError: a shard that lacks state this wrapper needs (merge the save's shards
                with :func:`distopt.merge_state_dicts`), or a state dict of another optimizer.
        """
        if not isinstance(self._mode, ShardedMode):
            state_dict = shards.whole(state_dict)
        self._mode.load_state_dict(self, state_dict)

    def broadcast_parameters(self) -> None:
        """Overwrite every rank's parameters with the root's (coalesced per device and dtype)."""
        self._check_not_retired("broadcast_parameters()")
        if self.world_size > 1 and self._params:
            with torch.no_grad(), stalls.inspected(self._engine.progress, "the parameter broadcast"):
                collectives.broadcast_parameters(self._params, src=self.root_rank, group=self._group())

    def broadcast_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state, e.g. when only the root loaded a checkpoint.

        Unlike Horovod, no optimizer step is taken to create the state first, so
        parameters and moments are exactly the root's. In local SGD the mode's state
        travels too: the step count, the steps since the last sync, the last-sync
        parameters and the outer optimizer's state.
        """
        self._check_not_retired("broadcast_optimizer_state()")
        if isinstance(self._mode, ShardedMode):
            raise RuntimeError(
                "broadcast_optimizer_state() with shard_state=True: each rank holds its own shard, so the root's "
                "state is not everyone's; load a full state dict on every rank with opt.load_state_dict() instead"
            )
        with stalls.inspected(self._engine.progress, "the optimizer-state broadcast"):
            collectives.broadcast_optimizer_state(self.optimizer, src=self.root_rank, group=self._group())
        self._mode.broadcast_state(self, self.root_rank)
