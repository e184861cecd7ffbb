"""``DistributedOptimizer``: data-parallel gradient averaging for any ``torch.optim`` optimizer.

This is the public wrapper, whole: its arguments; building what it runs on (a
private group, the gradient engine, the mode); taking parameters on (claimed,
checked across ranks, broadcast, hooked); the ``torch.optim.Optimizer`` surface
(:class:`~distopt.wrapper.forwarding.InnerOptimizerSurface`: param groups, hooks,
schedulers); ``step``/``zero_grad``/``synchronize``; state dicts and broadcasts;
and ``join()`` for uneven inputs. The hot path is the engine's
(:mod:`distopt.engine`); what happens at ``step()`` is the mode's
(:mod:`distopt.modes`), which sees the wrapper only through a
:class:`~distopt.modes.ModeContext`.

Three concerns live in modules of their own, which the wrapper calls through small
interfaces: ``join()`` (:mod:`distopt.wrapper.join`, through each wrapper's
:class:`~distopt.wrapper.join.JoinParty`), the registry of which wrapper each compressor
serves (:mod:`distopt.wrapper.compressor_owners`), and the glue to fault tolerance
(:mod:`distopt.fault_tolerance.wiring`). The engine is opened by
:func:`distopt.engine.opening.open_engine`, and the number of ranks lives in its
:class:`~distopt.engine.state.World`, which the wrapper and the mode's context ask.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from .. import collectives
from .. import compression as compression_module
from .. import fault_tolerance as ft
from ..compression import Compressor
from ..collectives.groups import check_member
from ..engine import GradientEngine, RoundState
from ..engine.opening import open_engine
from ..engine.state import World
from ..fault_tolerance import wiring
from ..modes import Mode, ModeContext, OuterFactory, resolve, settings_of, shards
from ..planning.drift import DriftReport
from ..planning.stats import StepStats
from ..planning.pack_size import choose_threshold
from ..transport import stalls
from ..transport.link_timing import measure_link
from . import checks, compressor_owners, ddp_guard
from .drift_check import DEFAULT_CHECK_EVERY, DriftCheck
from .forwarding import InnerOptimizerSurface
from .join import JoinParty, join, join_and_wait

__all__ = ["DistributedOptimizer", "StepStats", "DEFAULT_PACK_THRESHOLD", "COMPRESSION_KEY", "join", "join_and_wait"]

#: The key of the compressor's state (this rank's residuals, PowerSGD's Q) in ``state_dict()``.
COMPRESSION_KEY = "distopt_compression"

#: Default pack size in bytes (see docs/benchmark.md for how it was chosen).
DEFAULT_PACK_THRESHOLD = 10 * 2**20



class DistributedOptimizer(InnerOptimizerSurface):
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
            each gradient on its own; ``"auto"`` times the link when the parameters are
            first taken on and the root picks the size (:mod:`distopt.planning.pack_size`;
            ``stats.pack_threshold`` says which) (default: 10 MiB).
        bcast_period: re-broadcast parameters from ``root_rank`` after every
            ``bcast_period``-th step; ``0`` broadcasts only at construction; ``-1``
            never broadcasts (default: ``0``).
        backward_passes_per_step: backward passes accumulated locally before the
            gradients are reduced, on the last of them (default: ``1``).
        named_parameters: ``(name, parameter)`` pairs, e.g.
            ``model.named_parameters()``, so errors name parameters (default: None).
        process_group: the group to average over (default: the default group). A mode may average
            over part of it during backward (:meth:`distopt.modes.Mode.engine_group`): with
            :class:`distopt.Islands`, this rank's island, and ``rank``, ``world_size`` and
            ``root_rank`` are then within the island.
        root_rank: rank within ``process_group`` that broadcasts (default: ``0``).
        compression: how float packs travel: a :class:`distopt.compression.Compressor`
            (``PowerSGD(rank=4)``, ``Quantize(bits=8)``, ``TopK(group_size=64)``,
            ``Cast(torch.float16)``, or your own) or its name, one of
            ``distopt.compression.NAMES`` (``"int8"``, ``"topk"``, ``"powersgd"``, ...). Error feedback keeps what a
            compressor left out for the next step; that state is this rank's own and goes
            into ``state_dict()``. In local SGD the pseudo-gradients are compressed. None sends values as they are
            (default: None).
        sparse_as_dense: turn sparse gradients dense instead of raising (default: False).
        stall_warning: seconds a rank waits for the others in one of the wrapper's
            collectives before a warning names the ranks that have not arrived and
            where each was last seen; None for no warning (default: 60).
        stall_timeout: seconds after which every rank still waiting raises
            :class:`distopt.StallError` with that text; None waits as long as the
            process group's own timeout (default: None).
        mode: how local gradients become a step, an object that serves this wrapper alone:
            :class:`distopt.Synchronous` (gradients averaged during backward, the default),
            :class:`distopt.ShardedState` (ZeRO-1), :class:`distopt.LocalSGD` (periodic model
            averaging, streaming with ``fragments``), :class:`distopt.DiLoCo` (an outer
            optimizer) or :class:`distopt.Islands` (synchronous inside each host, one of the
            others between hosts); see docs/modes.md. Pass it or the shorthands below, not both (default: None).
        shard_state: shorthand for ``mode=distopt.ShardedState()`` (default: False).
        sync_every: shorthand: ``H > 1`` is ``mode=distopt.LocalSGD(every=H)``, or with
            ``outer_optimizer`` ``mode=distopt.DiLoCo(every=H, outer=...)`` (default: 1).
        outer_optimizer: shorthand for DiLoCo's ``outer``: builds the outer optimizer from the
            tensors it is given, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9,
            nesterov=True)`` (default: None).
        local_warmup: shorthand for the local modes' ``warmup`` (default: 0).
        sync_fragments: shorthand for the local modes' ``fragments`` (streaming) (default: None).
        sync_overlap: shorthand for the local modes' ``overlap`` (streaming) (default: None).
        sync_mixing: shorthand for the local modes' ``mixing`` (streaming) (default: None).
        check_every: the drift check: every ``check_every`` steps the ranks compare
            exact fingerprints of what the mode keeps identical on every rank (the
            parameters, and the optimizer state and hyperparameters where every rank
            holds them alike; in local SGD at the first sync due); with ``bcast_period``
            right before the first re-broadcast due, so that ``stats`` says what it
            corrected; ``0`` never (``check_drift()`` still works) (default: 100).
        drift_atol: a difference between the ranks up to ``drift_atol + drift_rtol x``
            the tensor's RMS is floating-point noise: reported in ``stats``, not raised;
            with both 0 any difference in the bits counts (default: 0.0).
        drift_rtol: see ``drift_atol`` (default: 0.0).
        on_drift: beyond the tolerance, ``"raise"`` :class:`distopt.DriftError` on every
            rank, or ``"warn"`` with :class:`distopt.DriftWarning` and train on (default: ``"raise"``).
        fault_tolerance: a torchft ``Manager`` (e.g. from
            :func:`distopt.fault_tolerance.manager.make_manager`): each process is one replica,
            the packs are all-reduced across the replicas through the manager, a step whose
            collectives fail when a replica dies is discarded, the survivors go on, and a
            replacement heals from a live peer. ``opt.fault_tolerance`` then says who trains
            (docs/fault-tolerance.md). With ``mode=distopt.Islands(...)`` a replica is an island
            of several processes (the process group), and the manager joins the islands.
            None: a fixed world (default: None).

    Raises:
        TypeError: if ``optimizer`` is not a ``torch.optim.Optimizer``, or a parameter is a DTensor
            (FSDP2's ``fully_shard``), which is not supported yet (on every rank, before any collective);
            or ``mode`` given together with a shorthand (``sync_every``, ``shard_state``, ...).
        ValueError: on a bad argument value or parameters that differ between ranks, or a ``mode``
            that serves another wrapper already.

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
        pack_threshold: Union[int, str] = DEFAULT_PACK_THRESHOLD,
        bcast_period: int = 0,
        backward_passes_per_step: int = 1,
        named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
        process_group: Optional[ProcessGroup] = None,
        root_rank: int = 0,
        compression: Union[str, Compressor, None] = None,
        sparse_as_dense: bool = False,
        stall_warning: Union[float, timedelta, None] = 60.0,
        stall_timeout: Union[float, timedelta, None] = None,
        mode: Optional[Mode] = None,
        shard_state: bool = False,
        sync_every: int = 1,
        outer_optimizer: Optional[OuterFactory] = None,
        local_warmup: int = 0,
        sync_fragments: Optional[int] = None,
        sync_overlap: Optional[int] = None,
        sync_mixing: Optional[float] = None,
        check_every: int = DEFAULT_CHECK_EVERY,
        drift_atol: float = 0.0,
        drift_rtol: float = 0.0,
        on_drift: str = "raise",
        fault_tolerance: Optional[Any] = None,
    ) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain torch.optim optimizer once")
        checks.check_arguments(optimizer, reduce_op, pack_threshold, bcast_period, backward_passes_per_step,
                               compression, sparse_as_dense)
        self.optimizer = optimizer
        self.reduce_op = reduce_op
        # "auto" stays "auto" here (it is a setting the ranks compare); the engine holds the size chosen.
        self.pack_threshold: Union[int, str] = (
            "auto" if pack_threshold == "auto" else checks.byte_count(pack_threshold, "pack_threshold", ""))
        self.bcast_period = int(bcast_period)
        self.compression = None if compression in (None, "none") else compression
        self.compressor: Optional[Compressor] = compression_module.resolve(compression)
        if self.compressor is not None:
            compressor_owners.bind(self.compressor, self)
        self.sparse_as_dense = sparse_as_dense
        # The mode owns its arguments (distopt.modes): the shorthands build one, and it refuses what it cannot do.
        self._mode: Mode = resolve(mode, shard_state=shard_state, sync_every=sync_every,
                                   outer_optimizer=outer_optimizer, local_warmup=local_warmup,
                                   sync_fragments=sync_fragments, sync_overlap=sync_overlap, sync_mixing=sync_mixing)
        self._mode.check_compatible(optimizer=optimizer, reduce_op=reduce_op, bcast_period=self.bcast_period,
                                    fault_tolerant=fault_tolerance is not None)
        self.check_every, self.drift_atol, self.drift_rtol, self.on_drift = checks.check_drift_arguments(
            check_every, drift_atol, drift_rtol, on_drift)
        self._drift = DriftCheck(self.check_every, self.drift_atol, self.drift_rtol, self.on_drift)
        self.stall_warning = checks.seconds(stall_warning, "stall_warning")
        self.stall_timeout = checks.seconds(stall_timeout, "stall_timeout")
        # None stays None (the default group, looked up per call): holding the default group would
        # keep it alive past destroy_process_group() into interpreter exit.
        self.process_group = process_group
        if process_group is not None:
            check_member(process_group, "process_group")
        # The ranks the engine averages over during backward: the group, or the part of it the mode says
        # (islands: this host's ranks); the wrapper's rank, world and root are within them.
        self._engine_group = self._mode.engine_group(process_group)
        self.rank = collectives.get_rank(self._engine_group)
        # The one count of the ranks: the engine's World (resized per step under fault tolerance), which
        # world_size and the mode's context read.
        self._world = World(collectives.get_world_size(self._engine_group))
        # ---- fault tolerance (distopt.fault_tolerance): the replicas' world is the manager's, per step.
        self.fault_tolerance: Optional[ft.FaultTolerance] = None
        if fault_tolerance is not None:
            # A mode that runs the manager above its own engine (islands) makes a replica of the whole group.
            ft.check_arguments(fault_tolerance, bcast_period=self.bcast_period, reduce_op=reduce_op,
                               process_group_size=1 if self._mode.fault_tolerance_above else self.world_size)
            self.check_every = 0  # the drift check's all-gather has no place in the manager's all-reduces
            self._drift = DriftCheck(0, self.drift_atol, self.drift_rtol, self.on_drift)
            self.fault_tolerance = ft.FaultTolerance(
                fault_tolerance, params=[], state_dict=self.state_dict, load_state_dict=self.load_state_dict,
                get_steps=lambda: self._engine.steps, set_steps=lambda n: self._context.set_steps(n),
                compressor=self.compressor, compression_key=COMPRESSION_KEY, settings=self._settings)
        # ----
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < self.world_size:
            raise ValueError(
                f"root_rank must be a rank of the process group (0..{self.world_size - 1}), got {root_rank!r}"
            )
        self.root_rank = root_rank
        self._names_by_id = checks.names_by_id(named_parameters, optimizer)
        if not self._mode.takes_dtensors:  # before the engine's first collective
            checks.no_dtensors(optimizer, self._names_by_id)
        self._engine = self._build_engine(backward_passes_per_step=int(backward_passes_per_step))
        self._retired_by: Optional[str] = None  # why this wrapper no longer reduces
        self._params: List[Tensor] = []  # every parameter this wrapper broadcasts, in tracking order
        self._context = ModeContext(
            optimizer=optimizer, engine=self._engine, params=self._params, names=self._names_by_id,
            process_group=self._engine_group, rank=self.rank, root_rank=root_rank,
            reduce_op=reduce_op, stall_warning=self.stall_warning, stall_timeout=self.stall_timeout,
            reduce_for_step=_weakly(self._reduce_for_step), synchronize=_weakly(self.synchronize),
            open_managed=self._managed_engines(),
        )
        if self.fault_tolerance is not None:
            self.fault_tolerance.params = self._params
            if self._mode.fault_tolerant(self.fault_tolerance):  # a quorum and a commit vote per sync, not per step
                self.fault_tolerance.per_step = False
        self._mode.bind(self)  # before it takes any state on
        self._join_party = JoinParty(engine=self._engine, mode=self._mode, context=self._context,
                                     fault_tolerance=self.fault_tolerance, root_rank=root_rank,
                                     check_usable=self._check_not_retired)
        self._track_new_params()
        self._mode.attach(self._context)
        self._ddp_watched = self.world_size > 1  # a model left in DDP shows at its first forward
        if self._ddp_watched:
            ddp_guard.watch(self)

    @property
    def mode(self) -> Mode:
        """The mode this wrapper trains in: the one passed as ``mode=``, or the one its shorthands built."""
        return self._mode

    @property
    def world_size(self) -> int:
        """Ranks the gradients are averaged over (under fault tolerance: the replicas of this step)."""
        return self._world.size

    @property
    def join_party(self) -> JoinParty:
        """This wrapper's part in a join block, for :func:`distopt.join` (:mod:`distopt.wrapper.join`)."""
        return self._join_party

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before the gradients are reduced, on the last of them."""
        return self._engine.backward_passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self._engine.set_backward_passes_per_step(passes)

    @property
    def stats(self) -> StepStats:
        """What the last reduction round (or step) did (packs, bytes on the wire, time waited), the
        bytes of optimizer state this rank holds, the extra memory the mode holds, and what the
        last drift check found."""
        stats = self._engine.stats
        stats.optimizer_state_bytes = sum(v.numel() * v.element_size() for state in self.optimizer.state.values()
                                          for v in state.values() if isinstance(v, Tensor))
        stats.extra_state_bytes = self._mode.extra_state_bytes(self._context)
        stats.pack_threshold = self._engine.config.pack_threshold
        self._drift.fill(stats)
        if self.fault_tolerance is not None:
            stats.fault_tolerance = self.fault_tolerance.stats()
        return stats

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's protocol with ``GradScaler``: True when the mode takes its verdict itself (local SGD),
        so that ``GradScaler.step`` always calls ``step()``, with ``found_inf`` and ``grad_scale`` set
        on the wrapper (:mod:`distopt.modes.amp`). Other modes keep ``GradScaler``'s usual path."""
        return self._mode.handles_amp_scaling

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

        Inside a join block the check and the broadcast would meet the shadow round of a rank that has run
        out of data, which cannot take part; so there it first asks, as :meth:`check_drift` does, whether one
        has (the last round's flags, or a probe round where they say that every rank trains), and refuses on
        every rank still training. Where no round tells (local SGD between two syncs) it cannot ask: a rank
        that ran out since the last sync leaves the others waiting, and the stall inspector names it.

        Raises:
            RuntimeError: called between ``backward()`` and ``step()``; or inside a join block after a rank
                ran out of data (on every rank still training, at once); the group is not added.
            TypeError: a DTensor parameter (FSDP2), which is not supported yet; the group is not added.
        """
        if self._engine.state != RoundState.OPEN:
            raise RuntimeError(
                "add_param_group() was called between backward() and step(); call it before "
                "backward() or after step()"
            )
        self._refuse_after_a_rank_joined("add_param_group()", _JOINED_BEFORE_ADD)
        self.optimizer.add_param_group(param_group)
        try:
            if not self._mode.takes_dtensors:
                checks.no_dtensors(self.optimizer, self._names_by_id, first_group=len(self.optimizer.param_groups) - 1)
        except TypeError:
            self.optimizer.param_groups.pop()
            raise
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
        if self._ddp_watched:  # the first forward has run: no need to watch the others
            self._ddp_watched = False
            ddp_guard.unwatch(self)
        engine, ctx = self._engine, self._context
        if engine.progress is not None:
            engine.progress.phase = "inside step()"
        # GradScaler sets these on the object whose step it calls when _step_supports_amp_scaling.
        ctx.found_inf, ctx.grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if (self.fault_tolerance is not None and self.fault_tolerance.per_step and not wiring.commit_or_discard(
                self.fault_tolerance, engine, self._reduce_for_step if self._mode.reduces_in_backward else None,
                closure)):
            ctx.found_inf = ctx.grad_scale = None
            return None
        try:
            loss = self._mode.step(ctx, closure)
        finally:
            ctx.found_inf = ctx.grad_scale = None
        engine.after_step()
        ctx.set_steps(engine.steps + 1)
        if self.fault_tolerance is not None:
            return loss
        # A rank that has joined cannot take part in a broadcast or a drift check (the join block's end
        # settles the state), so they run only where a round of this step says that every rank trains on
        # (in local SGD right after a sync), which the mode is asked only when one of them is due.
        rebroadcast = self.bcast_period > 0 and engine.steps % self.bcast_period == 0
        if ((rebroadcast or self._drift_due(rebroadcast))
                and self._mode.ranks_training(ctx) == self.world_size):
            report = self._scheduled_drift_check(rebroadcast)
            if rebroadcast:
                self.broadcast_parameters()
            if report is not None:  # after the re-broadcast, which leaves the ranks' parameters alike
                when = (f"right before the re-broadcast after step {engine.steps}" if rebroadcast
                        else f"after step {engine.steps} (check_every={self.check_every})")
                self._drift.act(report, when=when, root=self.root_rank, bcast_period=self.bcast_period,
                                stacklevel=2)
        return loss

    def check_drift(self) -> DriftReport:
        """Compare, now, every rank's copy of what the mode keeps identical on every rank.

        What the scheduled check (``check_every``) compares: the parameters, and the
        optimizer state and hyperparameters where the mode keeps them alike; in local SGD,
        between two syncs, the parameters' last-sync copies instead of the parameters.
        Every rank must call it at the same point. Beyond the tolerance it raises (or
        warns, per ``on_drift``) on every rank alike; ``stats`` holds its figures.

        Inside ``join()`` a rank that has run out of data cannot take part, and the others
        may not know yet that it has (it ran out since the last round). So there it first
        sends a probe round: one round of the gradients' size, zeros, which a rank that has
        joined shadows like any round (:meth:`distopt.modes.Mode.probe`); if it says that a
        rank has joined, every rank still training raises at once. Outside a join block
        nothing is sent before the check.

        Returns:
            What differs between the ranks (nothing in a world of one).

        Raises:
            DriftError: a difference beyond ``drift_atol``/``drift_rtol``, with ``on_drift="raise"``.
            RuntimeError: called while gradients are being averaged; or inside a join block after
                a rank has joined (on every rank still training, at once), between two syncs of
                local SGD, or with ``distopt.Islands`` of more than one island.
        """
        self._check_not_retired("check_drift()")
        if self.fault_tolerance is not None:
            raise RuntimeError(
                "check_drift() is not available with fault_tolerance: it all-gathers fingerprints, and the torchft "
                "Manager only all-reduces. Replicas cannot drift there: a replica that misses a step heals from a "
                "live peer at the next quorum")
        engine, ctx = self._engine, self._context
        if engine.state in (RoundState.IN_FLIGHT, RoundState.FLUSHED):
            raise RuntimeError(
                "check_drift() was called while the gradients of this step are still being averaged (another "
                "rank lagged at the end of backward); call it before backward() or after step(), or call "
                "opt.synchronize() first"
            )
        training = self.world_size if self.world_size == 1 else self._mode.ranks_training(ctx)
        if training is None and engine.join.in_block:
            self._refuse_in_join(
                "check_drift() was called inside a join block between two syncs of local SGD: a rank that runs out "
                "of data cannot take part, and the others learn that one has only from a sync's flags; call it "
                "right after a step that syncs (in streaming local SGD, one that sends a fragment), or after the "
                "block, where every rank holds the same state again"
            )
        if training is not None and training != self.world_size:
            self._refuse_in_join(_JOINED_BEFORE_CHECK)
        if engine.join.in_block and self._compared_size() > 1:
            self._probe_before_check()
        kept = None if self._compared_size() == 1 else self._mode.kept_identical(ctx, scheduled=False)
        if kept is None:
            return DriftReport(step=engine.steps)
        report = self._mode.agree_on_drift(ctx, self._drift.run(self._mode.whole_context(ctx), kept,
                                                                self._param_names()))
        self._drift.act(report, when=f"called as opt.check_drift() after step {engine.steps}", root=self.root_rank,
                        bcast_period=self.bcast_period, stacklevel=2)
        return report

    def _probe_in_join(self, what: str) -> Optional[int]:
        """Inside a join block, before ``what`` (a collective of the ranks still training): how many ranks train
        now, asked by a probe round (:meth:`distopt.modes.Mode.probe`), which the stall inspector names."""
        progress = self._engine.progress
        phase = None if progress is None else progress.phase
        if progress is not None:
            progress.phase = f"{what}'s probe round (inside a join block)"
        try:
            return self._mode.probe(self._context)
        finally:
            if progress is not None:
                progress.phase = phase

    def _probe_before_check(self) -> None:
        """Inside a join block: ask who trains now, by a probe round, and refuse the check, on every rank still
        training alike, where a rank has joined since the last round."""
        training = self._probe_in_join("check_drift()")
        if training is None:
            self._refuse_in_join(
                f"check_drift() was called inside a join block of {self._mode.describe()}: a rank of another island "
                "that has run out of data cannot take part, and no round of this island's tells whether one has; "
                "call it after the block, where every rank holds the same state again"
            )
        if training != self.world_size:
            self._refuse_in_join(_JOINED_BEFORE_CHECK)

    def _refuse_after_a_rank_joined(self, what: str, text: str) -> None:
        """Inside a join block, before ``what`` (a collective of every rank: ``add_param_group()``'s check and
        broadcast, a sharded ``state_dict()``'s gather): raise ``text``, on every rank still training alike,
        where a round (or, when the last one said that every rank trains, a probe round) says that a rank has
        joined, which would wait in a shadow round instead. Where no round can tell (local SGD between two
        syncs, islands) it goes on as outside a block."""
        if not self._engine.join.in_block or self._compared_size() == 1:
            return
        training = self._mode.ranks_training(self._context)
        if training == self.world_size:
            training = self._probe_in_join(what)
        if training is not None and training != self.world_size:
            self._refuse_in_join(text, where=f"{what} inside a join block")

    def _refuse_in_join(self, text: str, where: str = "check_drift() inside a join block") -> None:
        """Raise ``text`` from ``where`` inside a join block, published for the ranks that have joined:
        the others leave the block with it, and a joined rank's wait for them names it.

        Raises:
            RuntimeError: always.
        """
        error = RuntimeError(text)
        if self._engine.progress is not None:
            self._engine.progress.fail(where, error)
        raise error

    def _drift_due(self, rebroadcast: bool) -> bool:
        """Whether a drift check is due at this step; with ``bcast_period``, only right before a
        re-broadcast, when the drift since the last one is largest and the check can say what it corrects."""
        return (self._drift.due(self._engine.steps) and (self.bcast_period <= 0 or rebroadcast)
                and self._compared_size() > 1)

    def _compared_size(self) -> int:
        """Ranks the drift check compares: the mode's whole context's, which may hold more than the engine's
        (islands: every island; with FSDP2 inside, the wrapper's own world is this rank alone)."""
        return self._mode.whole_context(self._context).world_size

    def _scheduled_drift_check(self, rebroadcast: bool) -> Optional[DriftReport]:
        """Run the drift check if one is due at this step (:meth:`_drift_due`)."""
        if not self._drift_due(rebroadcast):
            return None
        kept = self._mode.kept_identical(self._context, scheduled=True)
        if kept is None:  # e.g. local SGD between two syncs: the next step tries again
            return None
        report = self._mode.agree_on_drift(
            self._context, self._drift.run(self._mode.whole_context(self._context), kept, self._param_names()))
        if rebroadcast:
            report.corrected = report.parameter_drift
        return report

    def _param_names(self) -> List[str]:
        """Every tracked parameter's name (``named_parameters``, else its place in the param groups)."""
        where = {id(p): (g, j) for g, j, p in checks.positions(self.optimizer, None)}
        return [self._context.name_of(p, *where.get(id(p), (0, i))) for i, p in enumerate(self._params)]

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
        engine.reset_round()
        if self.fault_tolerance is not None and self.fault_tolerance.per_step:
            self.fault_tolerance.start()  # the step's quorum overlaps the forward pass, as torchft's wrapper does

    def synchronize(self) -> None:
        """Finish averaging gradients now, e.g. before clipping or ``GradScaler.unscale_``.

        Gradients are normally final when ``backward()`` returns, but not when a
        rank lagged (the wait at the end of backward is bounded), when fewer than
        ``backward_passes_per_step`` passes ran, or when gradients were set by hand.
        Calling it again, or calling ``step()`` after it, does not reduce a second time.

        With ``mode=distopt.ShardedState(share="background")``, called after ``step()``, it waits until
        every rank holds every updated parameter: that share runs on after ``step()`` returns until the
        parameters are next used (a module's forward, ``model.state_dict()``), so call it before reading
        or changing parameters any other way (a weight EMA, ``clamp_()``). By default
        (``shard_state=True``) ``step()`` returns with every parameter shared.
        """
        self._check_not_retired("synchronize()")
        self._mode.finish_step(self._context)
        if self._reduces and self._mode.reduces_in_backward:  # local SGD keeps gradients local
            self._engine.synchronize(explicit=True)
        self._mode.synchronize(self._context)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients of the parameters this optimizer steps by their total norm, as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` over the full averaged gradient
        would, and return that norm (the same on every rank).

        With ``shard_state="gradients"`` each rank holds the averaged gradients of the parameters it
        owns only, so the norm is summed over the ranks: every rank must call it, at the same point
        (after ``backward()``, and after ``GradScaler.unscale_(opt)`` where a scaler is used); inside
        ``join()``, every rank still training (a rank that has joined owns no gradient).

        Args:
            max_norm: the largest total norm the gradients keep.
            norm_type: the norm's order (``float("inf")``: the largest absolute value).

        Returns:
            The total norm of the gradients before clipping.
        """
        self._check_not_retired("clip_grad_norm_()")
        self.synchronize()
        return self._mode.clip_grad_norm_(self._context, float(max_norm), float(norm_type))

    def sync_now(self) -> None:
        """Bring every rank to the same parameters now, e.g. before a checkpoint saved on one rank.

        In local SGD and DiLoCo the ranks train their own replicas between syncs; this syncs at once
        (a collective: every rank calls it at the same point, between two steps), and the next sync
        comes ``every`` steps later. In the modes that keep the ranks identical at every step it does
        nothing.

        Raises:
            RuntimeError: in streaming local SGD / DiLoCo, whose fragments sync at steps of their own,
                and under fault tolerance; the message says what to do instead.

        Example::

            >>> if step % 1000 == 0:
            ...     opt.sync_now()                      # on every rank
            ...     if distopt.get_rank() == 0:
            ...         torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        """
        self._check_not_retired("sync_now()")
        self._mode.finish_step(self._context)
        self._mode.sync_now(self._context)

    def _reduce_for_step(self) -> None:
        """Reduce what backward did not, as ``step()`` must (the modes call this, through their context)."""
        if self._reduces:
            self._engine.synchronize(explicit=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward passes accumulate gradients locally, without communication.

        The first reducing backward after it averages everything accumulated.
        """
        with self._engine.no_sync():
            yield

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
        broadcasts are skipped while a rank has joined; :meth:`check_drift` asks first,
        with a probe round, and raises on every rank still training once one has. An LR scheduler or a
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
        with join(self, divide_by_world=divide_by_world):
            yield

    def close(self) -> None:
        """Remove the gradient hooks, destroy the private group and release the parameters."""
        ddp_guard.unwatch(self)
        try:
            self._mode.finish_step(self._context)
        finally:
            self._engine.close()
        for p in self._params:
            checks.release(p, self)

    def __del__(self) -> None:
        # Only the object that built the engine closes it: a proxy whose class derives from the wrapper's
        # and that forwards attribute lookups to it (Lightning's LightningOptimizer) must not, when it is
        # collected, close the wrapper it stands for.
        if "_engine" in vars(self):
            with contextlib.suppress(Exception):
                self.close()

    # ------------------------------------------------------------------ state dicts and broadcasts

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict; loads into a plain optimizer and back.

        With ``shard_state=True`` it is gathered from every rank's shard, so every
        rank must call it; it is the same dict an unsharded optimizer would give.
        Local SGD adds its own state (step count, last-sync parameters, outer
        optimizer state) under the key ``"distopt_local_sgd"``, which a plain
        ``torch.optim`` optimizer's ``load_state_dict`` ignores.

        Raises:
            RuntimeError: with the state sharded, inside a join block after a rank ran out of data (on
                every rank still training, at once: that rank cannot send its shard).
        """
        if self._mode.gathers_state(self._context):
            self._refuse_after_a_rank_joined("state_dict()", _JOINED_BEFORE_GATHER)
        state = self._mode.state_dict(self._context)
        if self.compressor is not None:
            state[COMPRESSION_KEY] = self.compressor.state_dict()
        return state

    def sharded_state_dict(self) -> Dict[str, Any]:
        """With ``shard_state=True``: this rank's shard only, without communication (fast saves of
        large models: one file per rank); :func:`distopt.merge_state_dicts` rebuilds the full dict.

        In a world of one it is the only shard, the whole state, so a script that saves one
        file per rank runs unchanged. With compression it holds this rank's compressor state
        under ``"distopt_compression"``, as :meth:`state_dict` does (residuals are each rank's
        own), so that loading each rank's own shard resumes error feedback exactly.

        Raises:
            RuntimeError: the wrapper does not shard its state.
        """
        shard = self._mode.sharded_state_dict(self._context)
        if shard is None:
            raise RuntimeError("sharded_state_dict() needs shard_state=True; use state_dict()")
        if self.compressor is not None:
            shard[COMPRESSION_KEY] = self.compressor.state_dict()
        return shard

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this wrapper or a plain optimizer (with ``shard_state``, from any world size).

        A shard from :meth:`sharded_state_dict` loads as it is into the same rank of a sharded
        wrapper with the same world size and owners, and anywhere if it was saved at world size 1.

        The compressor's state loads from ``"distopt_compression"`` (a rank's own
        :meth:`state_dict` or shard), or from a merged dict's per-rank entries at the save's
        world size; at another world size a merged dict has no residuals that fit this rank,
        and error feedback starts over, with a ``RuntimeWarning``.

        Raises:
            ValueError: a shard that lacks state this wrapper needs (merge the save's shards
                with :func:`distopt.merge_state_dicts`), or a state dict of another optimizer.
        """
        state_dict, own, dropped = shards.own_part(state_dict, self.rank, self.world_size)
        if COMPRESSION_KEY in own and COMPRESSION_KEY not in state_dict:
            state_dict = dict(state_dict, **{COMPRESSION_KEY: own[COMPRESSION_KEY]})
        elif dropped and self.compressor is not None and COMPRESSION_KEY not in state_dict:
            warnings.warn(
                "load_state_dict() got a state dict merged from a save at another world size: the compressor "
                "residuals in it are each rank's own at that world size and fit no rank here, so error feedback "
                "starts over (what compression had left out at the save is dropped). For a resume that is "
                "exactly the uninterrupted run, resume at the save's world size (each rank loading its own shard)",
                RuntimeWarning, stacklevel=2)
        compressed = state_dict.get(COMPRESSION_KEY)
        if compressed is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != COMPRESSION_KEY}
        self._mode.load_state_dict(self._context, state_dict)
        if self.compressor is not None and compressed is not None:
            self.compressor.load_state_dict(compressed)

    def broadcast_parameters(self) -> None:
        """Overwrite every rank's parameters with the root's (coalesced per device and dtype)."""
        self._check_not_retired("broadcast_parameters()")
        self._mode.finish_step(self._context)
        whole = self._mode.whole_context(self._context)  # every rank, where the engine averages over part
        if whole.world_size > 1 and whole.params:  # the whole context's: islands over FSDP2 hold local shards there
            with torch.no_grad(), stalls.inspected(whole.progress, "the parameter broadcast"):
                collectives.broadcast_parameters(whole.params, src=whole.root_rank, group=whole.group)

    def broadcast_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state, e.g. when only the root loaded a checkpoint.

        Unlike Horovod, no optimizer step is taken to create the state first, so
        parameters and moments are exactly the root's. In local SGD the mode's state
        travels too: the step count, the steps since the last sync, the last-sync
        parameters and the outer optimizer's state.

        Raises:
            RuntimeError: with ``shard_state=True``, where every rank holds its own shard.
        """
        self._check_not_retired("broadcast_optimizer_state()")
        self._mode.broadcast_optimizer_state(self._context, self.root_rank)

    # ------------------------------------------------------------------ set-up

    def _build_engine(self, *, backward_passes_per_step: int) -> GradientEngine:
        """The gradient engine, over a private group of its own (none in a group of one), or over the
        torchft Manager under fault tolerance; it shares the wrapper's :class:`World`."""
        pack_threshold = DEFAULT_PACK_THRESHOLD if self.pack_threshold == "auto" else int(self.pack_threshold)
        if self._engine_over_manager:
            return wiring.open_engine(
                self.fault_tolerance, world=self._world, reduce_op=self.reduce_op, pack_threshold=pack_threshold,
                compressor=self.compressor, sparse_as_dense=self.sparse_as_dense,
                backward_passes_per_step=backward_passes_per_step)
        return open_engine(
            self._engine_group, reduce_op=self.reduce_op, pack_threshold=pack_threshold, compressor=self.compressor,
            sparse_as_dense=self.sparse_as_dense, backward_passes_per_step=backward_passes_per_step,
            root_rank=self.root_rank, stall_warning=self.stall_warning, stall_timeout=self.stall_timeout,
            world=self._world)

    @property
    def _engine_over_manager(self) -> bool:
        """Whether this wrapper's engine runs over the torchft Manager: under fault tolerance, unless the
        mode runs the manager on a level of its own (:attr:`~distopt.modes.Mode.fault_tolerance_above`)."""
        return self.fault_tolerance is not None and not self._mode.fault_tolerance_above

    def _managed_engines(self) -> Optional[Callable[[Optional[Compressor]], GradientEngine]]:
        """What opens an engine over the torchft Manager for a mode that runs it above this wrapper's engine
        (:meth:`~distopt.modes.ModeContext.open_managed_engine`), or None."""
        fault_tolerance = self.fault_tolerance
        if fault_tolerance is None or not self._mode.fault_tolerance_above:
            return None
        reduce_op, sparse_as_dense = self.reduce_op, self.sparse_as_dense
        pack_threshold = self._engine.config.pack_threshold

        def open_managed(compressor: Optional[Compressor]) -> GradientEngine:
            return wiring.open_engine(fault_tolerance, world=World(1), reduce_op=reduce_op,
                                      pack_threshold=pack_threshold, compressor=compressor,
                                      sparse_as_dense=sparse_as_dense, backward_passes_per_step=1)

        return open_managed

    @property
    def _reduces(self) -> bool:
        """Whether gradients are reduced at all: a world of more than one, or replicas under fault tolerance."""
        return self.world_size > 1 or self.fault_tolerance is not None

    def _settings(self) -> Dict[str, Any]:
        """Every setting that decides which collectives run; they must match on every rank.

        They are the user's arguments, whatever the mode, so that an error about ranks that
        differ names an argument; the mode itself comes last, as a backstop.
        """
        return {
            "reduce_op": self.reduce_op,
            "pack_threshold": self.pack_threshold,
            "compression": None if self.compressor is None else self.compressor.settings(),
            "bcast_period": self.bcast_period,
            "backward_passes_per_step": self.backward_passes_per_step,
            "sparse_as_dense": self.sparse_as_dense,
            "root_rank": self.root_rank,
            "check_every": self.check_every,
            "drift_atol": self.drift_atol,
            "drift_rtol": self.drift_rtol,
            "on_drift": self.on_drift,
            **settings_of(self._mode),
        }

    def _track_new_params(self) -> None:
        """Take on the parameters not held yet: claim them, check them across ranks, broadcast them,
        reduce their gradients.

        Each parameter is reduced by one wrapper only, the newest built over it, so an
        older wrapper whose parameters are claimed is retired for good. Frozen parameters
        are broadcast too, and reduced once they become trainable.

        Raises:
            ValueError: the ranks built different optimizers (settings or parameters).
            StallError: a rank did not arrive at the check or the broadcast in time.
        """
        known = {id(p) for p in self._params}
        new: List[Tensor] = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    known.add(id(p))
                    new.append(p)
        names = [self._context.name_of(p, g, j) for g, j, p in checks.positions(self.optimizer, new)]
        for p in new:
            previous = checks.claim(p, self)
            if previous is not None:
                previous._retire()
        self._params.extend(new)
        engine = self._engine
        if self._engine_over_manager and new:
            # No check across replicas and no broadcast: the replicas come and go, and torchft heals a
            # replica that joins (at step 0 too: init_sync) with a live peer's parameters.
            engine.track(new, names)  # in registration order: no root to broadcast another (EngineConfig.fixed_plan)
            self._mode.on_track(self._context, new)
            return
        if self.world_size == 1 or not new:
            engine.reset_round()
            return
        group = self._context.group
        with stalls.inspected(engine.progress, "the check that every rank built the same optimizer"):
            checks.check_agreement(self._settings(), new, names, group, self.root_rank)
        if self.pack_threshold == "auto" and not engine.params:
            with stalls.inspected(engine.progress, "the timing of the link (pack_threshold='auto')"):
                engine.reconfigure(pack_threshold=self._auto_threshold(new))
        if self.bcast_period != -1:
            with torch.no_grad(), stalls.inspected(engine.progress, "the broadcast of the initial parameters"):
                collectives.broadcast_parameters(new, src=self.root_rank, group=group)
        engine.track(new, names)
        self._mode.on_track(self._context, new)

    def _auto_threshold(self, params: List[Tensor]) -> int:
        """The root times the link and picks the pack size; every rank takes the root's."""
        total = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        device = params[0].device
        timing = measure_link(self._engine.channel.group, device)
        trainable = [p for p in params if p.requires_grad]
        fraction = 1.0
        if self.compressor is not None and trainable:
            fraction = self.compressor.wire_fraction([p.shape for p in trainable], trainable[0].dtype)
        chosen = torch.tensor([choose_threshold(timing, total, fraction)], dtype=torch.int64, device=device)
        collectives.broadcast(chosen, src=self.root_rank, group=self._engine.channel.group)
        return int(chosen.item())

    def _retire(self) -> None:
        """A newer wrapper took this one's parameters over: stop reducing, for good."""
        try:
            self._mode.finish_step(self._context)  # the parameters arrive before the newer wrapper takes them
        finally:
            self._engine.close()
        if self.compressor is not None:  # another wrapper may take it now
            compressor_owners.release(self.compressor, self)
        self._retired_by = "a newer DistributedOptimizer was built over the same parameters and took them over"

    def _check_not_retired(self, what: str) -> None:
        if self._retired_by is not None:
            raise RuntimeError(
                f"{what} on a DistributedOptimizer that no longer reduces: {self._retired_by}. Use the newer "
                "wrapper (each parameter is reduced by one wrapper, the newest one built over it)"
            )


_JOINED_BEFORE_ADD = (
    "add_param_group() was called inside a join block after a rank ran out of data: that rank cannot take part in "
    "checking and broadcasting the new parameters; add the group before the block or after it (a parameter that "
    "becomes trainable inside the block can be in the optimizer from the start, frozen, and unfrozen there)"
)

_JOINED_BEFORE_GATHER = (
    "state_dict() was called inside a join block after a rank ran out of data: with the optimizer state sharded it "
    "gathers every rank's shard, and that rank cannot take part; save after the block, where every rank holds its "
    "own shard again"
)

_JOINED_BEFORE_CHECK = (
    "check_drift() was called inside a join block after a rank ran out of data: that rank cannot take part; call it "
    "after the block, where every rank holds the same state again"
)


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference to its object, so that the mode's context does not
    keep a dropped wrapper alive (its hooks would keep firing until a garbage collection)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call
