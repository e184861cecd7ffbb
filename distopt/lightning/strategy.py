"""``DistoptStrategy``: Lightning's DDP strategy with the model left alone and the optimizers wrapped.

Lightning's ``"ddp"`` strategy wraps the ``LightningModule`` in
``DistributedDataParallel``. This one launches, connects and shards the data exactly
as that strategy does (it is a subclass: the same launchers, cluster environments,
``DistributedSampler`` and process group), but leaves the module as it is and wraps
each optimizer that ``configure_optimizers`` returns in a
:class:`distopt.DistributedOptimizer`, with the options it was given. Gradients are
then final when ``backward()`` returns, so ``gradient_clip_val``, mixed precision
(``GradScaler``) and the LR schedulers read averaged gradients as under ``"ddp"``.

What Lightning does around the optimizer, and what becomes of it:

* ``accumulate_grad_batches=k``: the first k-1 backward passes run inside
  ``block_backward_sync()``, which is every wrapper's ``no_sync()``; the k-th averages
  everything accumulated.
* the optimizer step: Lightning hands ``step`` a closure (forward and backward). The
  wrapper evaluates it, averages its gradients and the loss it returns over the ranks
  (one 16-byte all-reduce more per step than ``"ddp"``), so an optimizer that calls
  the closure several times (LBFGS) takes the same steps on every rank.
* checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``ckpt_path=``): every
  rank builds the checkpoint and rank 0 writes it, as under ``"ddp"``. With
  ``shard_state=True`` each optimizer's state is gathered from every rank's shard into
  the dict a plain optimizer would give, and loads back at any world size. A
  compressor's error feedback is each rank's own: the checkpoint keeps every rank's,
  and a resume at the same world size gives each rank its own back; at another world
  size error feedback starts afresh (with a warning).
* local SGD and DiLoCo (``sync_every``, ``outer_optimizer``): between two syncs every
  rank trains its own replica, so a checkpoint holds rank 0's.

Fault tolerance (``fault_tolerance=``) is refused: Lightning's launchers restart the
whole job when a process dies, while torchft keeps the survivors training and heals a
replacement replica; use ``python -m distopt.fault_tolerance.launch`` for that.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch.distributed as dist
from torch.optim import Optimizer

import pytorch_lightning as pl
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_info

from .. import collectives
from ..wrapper import DistributedOptimizer
from ..wrapper.optimizer import COMPRESSION_KEY

__all__ = ["DistoptStrategy", "RANKS_KEY"]

#: Where a checkpoint keeps every rank's compressor state (error feedback), by rank.
RANKS_KEY = "distopt_compression_by_rank"

# Arguments the strategy sets itself, or refuses, rather than passing on.
_OWN = {"optimizer", "named_parameters", "process_group"}
_REFUSED = {
    "fault_tolerance": (
        "fault_tolerance= is not supported under Lightning: Lightning's launchers restart the whole job when a "
        "process dies, while torchft keeps the survivors training and heals a replacement replica from them. Train "
        "fault-tolerant replicas with `python -m distopt.fault_tolerance.launch` and a plain training loop "
        "(docs/fault-tolerance.md)"),
}


def _distopt_options() -> List[str]:
    return [name for name, p in inspect.signature(DistributedOptimizer.__init__).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]


class DistoptStrategy(DDPStrategy):
    """Lightning's DDP strategy, with every optimizer wrapped in a :class:`distopt.DistributedOptimizer`.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as :class:`pytorch_lightning.strategies.DDPStrategy`'s
            (default: Lightning's).
        **options: keyword arguments of :class:`distopt.DistributedOptimizer` (``compression``,
            ``shard_state``, ``sync_every``, ``outer_optimizer``, ``check_every``, ...), the same for
            every optimizer of the module. ``named_parameters`` comes from the module.

    Raises:
        TypeError: an option that :class:`distopt.DistributedOptimizer` does not take.
        ValueError: ``fault_tolerance=`` (see the module).

    Example::

        >>> trainer = pl.Trainer(accelerator="cpu", devices=2,
        ...                      strategy=distopt.lightning.DistoptStrategy(compression="int8"))
        >>> trainer.fit(model, datamodule=data)          # the LightningModule is unchanged
    """

    strategy_name = "distopt"

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Any = None, start_method: str = "popen", **options: Any) -> None:
        known = _distopt_options()
        for name in options:
            if name in _REFUSED:
                raise ValueError(_REFUSED[name])
            if name in _OWN or name not in known:
                hint = ("the strategy passes each module's named_parameters and the default group itself"
                        if name in _OWN else f"it takes {', '.join(n for n in known if n not in _OWN | set(_REFUSED))}")
                raise TypeError(f"DistoptStrategy got an option DistributedOptimizer does not take from it: "
                                f"{name}={options[name]!r}; {hint}")
        kwargs: Dict[str, Any] = {"start_method": start_method}
        if timeout is not None:
            kwargs["timeout"] = timeout
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend, **kwargs)
        self.options: Dict[str, Any] = dict(options)

    # ------------------------------------------------------------------ the model stays as it is

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: the ranks start from rank 0's parameters and buffers instead,
        as DDP's construction gives them (the wrappers then keep the parameters identical)."""
        assert self.model is not None
        if self.world_size > 1:
            collectives.broadcast_parameters(list(self.model.parameters()) + list(self.model.buffers()), src=0)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Lightning's optimizers and schedulers, each optimizer wrapped in a DistributedOptimizer.

        The schedulers keep pointing at the inner optimizers, whose param groups the wrappers share.
        """
        super().setup_optimizers(trainer)
        module = self.lightning_module
        assert module is not None
        named = list(module.named_parameters())
        wrapped = []
        for optimizer in self.optimizers:
            if isinstance(optimizer, DistributedOptimizer):
                raise TypeError("configure_optimizers() returned a DistributedOptimizer, and DistoptStrategy wraps "
                                "each optimizer itself: return the plain torch.optim optimizer")
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            wrapped.append(DistributedOptimizer(
                optimizer, named_parameters=[(n, p) for n, p in named if id(p) in mine], **self.options))
        self.optimizers = wrapped
        rank_zero_info(f"DistoptStrategy: {len(wrapped)} optimizer(s) wrapped in distopt.DistributedOptimizer")

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Backward passes that only accumulate (``accumulate_grad_batches``): every wrapper's ``no_sync()``."""
        with contextlib.ExitStack() as stack:
            for optimizer in self._wrappers():
                stack.enter_context(optimizer.no_sync())
            yield None

    # ------------------------------------------------------------------ checkpoints

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """The optimizer's state for a checkpoint, on every rank (``shard_state`` gathers it there), with
        every rank's compressor state by rank."""
        wrapper = _unwrap(optimizer)
        state = dict(wrapper.state_dict())
        if isinstance(wrapper, DistributedOptimizer) and COMPRESSION_KEY in state:
            mine = state.pop(COMPRESSION_KEY)
            state[RANKS_KEY] = (collectives.all_gather_object(mine) if wrapper.world_size > 1 else [mine])
        return state

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's state from the checkpoint; each rank takes back its own compressor state."""
        states = checkpoint["optimizer_states"]
        adapted = []
        for optimizer, state in zip(self.optimizers, states):
            state = dict(state)
            by_rank = state.pop(RANKS_KEY, None)
            if by_rank is not None:
                wrapper = _unwrap(optimizer)
                world = wrapper.world_size if isinstance(wrapper, DistributedOptimizer) else 1
                if len(by_rank) == world:
                    state[COMPRESSION_KEY] = by_rank[dist.get_rank() if world > 1 else 0]
                else:
                    warnings.warn(
                        f"the checkpoint holds the compressor state (error feedback) of {len(by_rank)} ranks and "
                        f"this run has {world}: error feedback starts afresh (each rank's residuals are its own)",
                        stacklevel=2)
            adapted.append(state)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": adapted})

    def teardown(self) -> None:
        """Remove the wrappers' hooks and private groups, then Lightning's teardown."""
        for optimizer in self._wrappers():
            optimizer.close()
        super().teardown()

    def _wrappers(self) -> List[DistributedOptimizer]:
        return [w for w in (_unwrap(o) for o in self.optimizers) if isinstance(w, DistributedOptimizer)]


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
