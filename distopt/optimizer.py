"""``DistributedOptimizer``: data-parallel gradient averaging for any ``torch.optim`` optimizer.

This is the public front: the arguments, the ``torch.optim.Optimizer`` surface
(param groups, hooks, schedulers; state dicts and broadcasts in
:mod:`distopt.checkpointing`) and ``step``/``zero_grad``/``synchronize``. The hot path lives in :class:`distopt.engine.GradientEngine`;
what happens at ``step()`` is the mode's (:mod:`distopt.modes`); the channel,
engine and mode are built in :mod:`distopt.wiring`; parameters are taken on
(claimed, checked across ranks, broadcast) in :mod:`distopt.tracking`; argument
and cross-rank checks are in :mod:`distopt.checks`.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from . import checks, collectives, joining, tracking, wiring
from .collectives.groups import check_member
from .rounds import IDLE
from .checkpointing import StateSurface
from .forwarding import InnerOptimizerSurface
from .modes import LocalSGDMode, Mode
from .modes.local_sgd import OuterFactory
from .modes.sharded import state_bytes
from .stats import StepStats

__all__ = ["DistributedOptimizer", "StepStats", "DEFAULT_PACK_THRESHOLD"]

#: Default pack size in bytes (see the README's benchmark section for how it was chosen).
DEFAULT_PACK_THRESHOLD = 10 * 2**20


class DistributedOptimizer(StateSurface, InnerOptimizerSurface):
    r"""Wrap an optimizer so that every ``step()`` applies gradients averaged over all ranks.

    During the reducing backward pass a hook on each parameter moves its ready
    gradient into a persistent flat buffer shared with the other members of its
    *pack* (one (device, dtype) each, never mixed or cast). Once every member of
    a pack is ready, one asynchronous all-reduce is launched for it, overlapping
    the rest of backward. At the end of backward the remaining packs are sent, all
    are awaited and each parameter's ``.grad`` is left as a view of its averaged
    slice of the buffer, so anything that reads gradients after ``backward()``
    (clipping, ``GradScaler``, logging) sees the final values and nothing is copied
    back.

    **Identical collectives on every rank.** Collectives are matched by call
    order, so packs launch strictly in the order of a plan that every rank holds
    identically: a pack waits for all earlier packs, whatever order hooks fire in.
    The first plan follows reverse parameter order (gradients usually arrive in
    that order). After the first reducing round the root broadcasts the order its
    gradients actually arrived in, and every rank rebuilds the same fixed plan
    from it. Parameters without a local gradient are sent as zeros with a
    presence flag, so a parameter used on only some ranks is averaged with zeros
    from the others, and one used on no rank keeps ``grad = None``. Ranks that
    disagree on the parameters fail at construction with an error naming the first
    difference.

    In a single process, or a group of one, no hook is installed and the wrapper
    is bitwise identical to the inner optimizer.

    Args:
        optimizer: the optimizer to wrap (any :class:`torch.optim.Optimizer`).
        reduce_op: ``"mean"`` averages gradients over ranks, ``"sum"`` adds them
            (default: ``"mean"``).
        pack_threshold: a pack is launched once it holds this many bytes; ``0`` sends
            each gradient on its own (default: 10 MiB).
        bcast_period: re-broadcast parameters from ``root_rank`` after every
            ``bcast_period``-th step; ``0`` broadcasts only at construction; ``-1``
            never broadcasts (default: ``0``).
        backward_passes_per_step: backward passes accumulated locally before the
            gradients are reduced, on the last of them (default: ``1``).
        named_parameters: ``(name, parameter)`` pairs, e.g.
            ``model.named_parameters()``, so errors name parameters (default: None).
        process_group: the group to average over (default: the default group).
        root_rank: rank within ``process_group`` that broadcasts (default: ``0``).
        compression: ``"fp16"`` or ``"bf16"`` sends float32/float64 packs as 16-bit
            on the wire (mean scaling applied before the cast) (default: None).
        sparse_as_dense: turn sparse gradients dense instead of raising (default: False).
        stall_warning: seconds a rank waits for the others in one of the wrapper's
            collectives before a warning names the ranks that have not arrived and
            where each was last seen; None for no warning (default: 60).
        stall_timeout: seconds after which every rank still waiting raises
            :class:`distopt.StallError` with that text; None waits as long as the
            process group's own timeout (default: None).
        shard_state: each rank keeps the optimizer state of the parameters it owns
            only (ZeRO-1); see :mod:`distopt.modes.sharded` (default: False).
        sync_every: local SGD: gradients stay local, and every ``sync_every``-th step
            the ranks average their parameters (see :mod:`distopt.modes.local_sgd`);
            ``1`` is synchronous training (default: 1).
        outer_optimizer: DiLoCo: builds the outer optimizer from the tensors it is
            given, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9,
            nesterov=True)``; at each sync it steps on the mean pseudo-gradient
            (last-sync parameters minus local ones). None averages (default: None).
        local_warmup: synchronous steps before local SGD starts (default: 0).

    Raises:
        TypeError: if ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: on a bad argument value or parameters that differ between ranks.

    Example::

        >>> model = Net()
        >>> opt = distopt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()   # packs are all-reduced during backward
        ...     opt.step()
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        reduce_op: str = "mean",
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        bcast_period: int = 0,
        backward_passes_per_step: int = 1,
        named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
        process_group: Optional[ProcessGroup] = None,
        root_rank: int = 0,
        compression: Optional[str] = None,
        sparse_as_dense: bool = False,
        stall_warning: Union[float, timedelta, None] = 60.0,
        stall_timeout: Union[float, timedelta, None] = None,
        shard_state: bool = False,
        sync_every: int = 1,
        outer_optimizer: Optional[OuterFactory] = None,
        local_warmup: int = 0,
    ) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain torch.optim optimizer once")
        checks.check_arguments(optimizer, reduce_op, pack_threshold, bcast_period, backward_passes_per_step,
                               compression, sparse_as_dense)
        self.optimizer = optimizer
        self.reduce_op = reduce_op
        self.pack_threshold = checks.byte_count(pack_threshold, "pack_threshold", "0 sends each gradient alone")
        self.bcast_period = int(bcast_period)
        self.compression = None if compression in (None, "none") else compression
        self.sparse_as_dense = sparse_as_dense
        self.shard_state = checks.shard_state(shard_state, optimizer)
        local = checks.check_local_sgd(sync_every, outer_optimizer, local_warmup, reduce_op, bcast_period,
                                       self.shard_state)
        self.stall_warning = checks.seconds(stall_warning, "stall_warning")
        self.stall_timeout = checks.seconds(stall_timeout, "stall_timeout")
        # None stays None (the default group, looked up per call): holding the default group would
        # keep it alive past destroy_process_group() into interpreter exit.
        self.process_group = process_group
        if process_group is not None:
            check_member(process_group, "process_group")
        self.rank = collectives.get_rank(self.process_group)
        self.world_size = collectives.get_world_size(self.process_group)
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < self.world_size:
            raise ValueError(
                f"root_rank must be a rank of the process group (0..{self.world_size - 1}), got {root_rank!r}"
            )
        self.root_rank = root_rank
        self._names_by_id = checks.names_by_id(named_parameters, optimizer)
        self._engine = wiring.build_engine(
            process_group, self.world_size, mean=reduce_op == "mean",
            wire_dtype=checks.COMPRESSIONS[self.compression], pack_threshold=self.pack_threshold,
            sparse_as_dense=sparse_as_dense, backward_passes_per_step=int(backward_passes_per_step),
            root_rank=root_rank, stall_warning=self.stall_warning, stall_timeout=self.stall_timeout,
        )
        self._mode: Mode = wiring.choose_mode(
            local=local, shard_state=self.shard_state, rank=self.rank, world_size=self.world_size,
            sync_every=int(sync_every), outer_optimizer=outer_optimizer, local_warmup=int(local_warmup),
        )
        self._retired_by: Optional[str] = None  # why this wrapper no longer reduces
        self._steps = 0
        self._params: List[Tensor] = []  # every parameter this wrapper broadcasts, in tracking order
        self._track_new_params()
        self._mode.attach(self)

    @property
    def _steps(self) -> int:
        """Steps taken; every rank's count travels with each round (see :mod:`distopt.control`)."""
        return self._engine.steps

    @_steps.setter
    def _steps(self, steps: int) -> None:
        self._engine.steps = steps

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before the gradients are reduced, on the last of them."""
        return self._engine.backward_passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self._engine.backward_passes_per_step = passes

    @property
    def stats(self) -> StepStats:
        """What the last reduction round (or step) did (packs, bytes on the wire, time waited), the
        bytes of optimizer state this rank holds, and the extra memory the mode holds."""
        stats = self._engine.stats
        stats.optimizer_state_bytes = state_bytes(self.optimizer)
        stats.extra_state_bytes = self._mode.extra_state_bytes(self)
        return stats

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Local SGD only: ``GradScaler`` then calls ``step()`` every time, with ``found_inf`` and
        ``grad_scale`` set on the wrapper, so a rank that skips its inner step still counts it
        (:mod:`distopt.modes.amp`). Other modes keep ``GradScaler``'s usual path."""
        return isinstance(self._mode, LocalSGDMode)

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({self.optimizer!r}, reduce_op={self.reduce_op!r}, "
            f"pack_threshold={self.pack_threshold}, world_size={self.world_size})"
        )

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError(
            "a DistributedOptimizer cannot be pickled (it holds hooks and a process group); "
            "save opt.state_dict() instead"
        )

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer and start averaging its gradients.

        Every rank must add the same group. Its parameters are checked across ranks
        and broadcast from the root like those given at construction.
        """
        if self._engine.state != IDLE:
            raise RuntimeError(
                "add_param_group() was called between backward() and step(); call it before "
                "backward() or after step()"
            )
        self.optimizer.add_param_group(param_group)
        self._track_new_params()

    # ------------------------------------------------------------------ training loop

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Average any gradients not averaged yet, then take the inner optimizer's step.

        With a ``closure`` (e.g. LBFGS), every call of it is followed by a reduction
        of the gradients it computed.

        Args:
            closure: re-evaluates the model and returns the loss (default: None).

        Returns:
            Whatever the inner optimizer's ``step`` returns.
        """
        self._check_not_retired("step()")
        engine = self._engine
        if engine.progress is not None:
            engine.progress.phase = "inside step()"
        loss = self._mode.step(self, closure)
        engine.after_step()
        self._steps += 1
        if engine.progress is not None:
            engine.progress.step = self._steps
        # While a rank has joined it cannot take part in a broadcast; the join block's end settles the state.
        if self.bcast_period > 0 and self._steps % self.bcast_period == 0 and engine.contributors == self.world_size:
            self.broadcast_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (see :meth:`torch.optim.Optimizer.zero_grad`) and start a new round.

        Args:
            set_to_none: set ``.grad`` to None instead of zeroing it (default: True).
        """
        engine = self._engine
        if engine.inflight:  # a round left pending: settle it (plan, capacities, checks) as the other ranks did
            with engine.lock:
                engine.finish_round()
        self.optimizer.zero_grad(set_to_none)
        self._engine.reset_round()

    def synchronize(self) -> None:
        """Finish averaging gradients now, e.g. before clipping or ``GradScaler.unscale_``.

        Gradients are normally final when ``backward()`` returns; this also
        reduces them when fewer than ``backward_passes_per_step`` passes ran, or
        when gradients were set by hand. Calling it again, or calling ``step()``
        after it, does not reduce a second time.
        """
        self._check_not_retired("synchronize()")
        if self.world_size > 1 and self._mode.reduces_in_backward:  # local SGD keeps gradients local
            self._engine.synchronize(explicit=True)

    def _reduce_for_step(self) -> None:
        """Reduce what backward did not, as ``step()`` must (the modes call this)."""
        if self.world_size > 1:
            self._engine.synchronize(explicit=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward passes accumulate gradients locally, without communication.

        The first reducing backward after it averages everything accumulated.
        """
        engine = self._engine
        previous, engine.sync_enabled = engine.sync_enabled, False
        try:
            yield
        finally:
            engine.sync_enabled = previous

    @contextlib.contextmanager
    def join(self, divide_by_world: bool = False) -> Iterator[None]:
        """Context around a training loop in which ranks may run different numbers of steps.

        A rank whose loop ends first waits at the end of the block, taking part in
        the other ranks' gradient reductions with zeros, until every rank has
        finished; then all leave the block together, with the same parameters and
        optimizer state, bitwise (the ranks that stopped early receive those of a
        rank that ran the longest). While no rank has finished, nothing extra is
        communicated: whether a rank has joined travels in flags inside the packs.

        Every rank must enter the block; several optimizers stepped in one loop
        join together, with :func:`distopt.join`. Inside the block, once a rank has finished, the
        others must not run collectives of their own (a metric's all-reduce, a
        barrier, ``add_param_group``, ``broadcast_parameters()``): the finished rank
        cannot take part in them. Move them after the block. ``bcast_period``
        broadcasts are skipped while a rank has joined. An LR scheduler or a
        ``GradScaler`` on a finished rank is not advanced: step them per epoch,
        after the block, or from the optimizer's own state.

        Args:
            divide_by_world: average over all ranks, counting the finished ones as
                zeros (DDP's and Horovod's behaviour), instead of over the ranks that
                contributed to the step (default: False).

        Raises:
            RuntimeError: only some ranks are inside a join block, or they pass
                different ``divide_by_world`` (raised on every rank at the next reduction).

        Example::

            >>> with opt.join():
            ...     for x, y in loader:          # a different number of batches per rank
            ...         opt.zero_grad()
            ...         loss_fn(model(x), y).backward()
            ...         opt.step()
        """
        with joining.join(self, divide_by_world=divide_by_world):
            yield

    def close(self) -> None:
        """Remove the gradient hooks, destroy the private group and release the parameters."""
        self._engine.close()
        for p in self._params:
            checks.release(p, self)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ set-up

    def _group(self) -> Optional[ProcessGroup]:
        channel = self._engine.channel
        return channel.group if channel is not None else self.process_group

    def _settings(self) -> Dict[str, Any]:
        return tracking.settings(self)

    def _track_new_params(self) -> None:
        tracking.track_new_params(self)

    def _retire(self) -> None:
        """A newer wrapper took this one's parameters over: stop reducing, for good."""
        self._engine.close()
        self._retired_by = "a newer DistributedOptimizer was built over the same parameters and took them over"

    def _check_not_retired(self, what: str) -> None:
        if self._retired_by is not None:
            raise RuntimeError(
                f"{what} on a DistributedOptimizer that no longer reduces: {self._retired_by}. Use the newer "
                "wrapper (each parameter is reduced by one wrapper, the newest one built over it)"
            )
