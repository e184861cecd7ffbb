"""The seam between :class:`distopt.DistributedOptimizer` and the modes that plug into it.

The public class keeps the arguments and the ``torch.optim`` surface; the
:class:`distopt.engine.GradientEngine` under it owns the hooks, the packs and
the reduction round. A mode never sees the wrapper: every method is handed a
:class:`ModeContext`, the small typed view of it that a mode needs (the inner
optimizer, the engine, the tracked parameters, the group, the step count), the
way torchft hands its ``Manager`` to an optimizer wrapper. The wrapper asks the
mode through methods and attributes (:attr:`Mode.reduces_in_backward`,
:attr:`Mode.handles_amp_scaling`, :meth:`Mode.sharded_state_dict`, ...), never by
its type. A mode is a public object the user may pass (``DistributedOptimizer(opt,
mode=distopt.DiLoCo(...))``), and it owns its arguments: its constructor declares and checks
them, :meth:`Mode.settings` says which the ranks must agree on, and
:meth:`Mode.check_compatible` refuses the wrapper's arguments it cannot work with. The flat
keyword arguments (``sync_every=``, ``shard_state=``, ...) are shorthands that
:mod:`distopt.modes.shorthands` turns into a mode. So adding a mode is its file, one
registration line in :mod:`distopt.modes` and its tests. A mode decides the two things that
differ between ways of training data-parallel:

1. **Gradients at the end of backward** (:attr:`Mode.reduces_in_backward`).
   True: the engine's hooks average every gradient while backward runs, and
   ``.grad`` is final when ``backward()`` returns (synchronous training, and
   sharded optimizer state, which also needs averaged gradients). False: the
   gradients stay local (local SGD, DiLoCo), and the mode communicates in
   :meth:`Mode.step` instead.
2. **What happens at step** (:meth:`Mode.step`). The synchronous mode finishes
   any reduction still due and runs the inner optimizer. Other modes may step
   only the parameters they own and then share them, or average parameters
   every H steps.

After :meth:`Mode.step` returns, the wrapper starts a new round, counts the step
and re-broadcasts parameters when ``bcast_period`` says so; a mode does not.

A mode may also take part in the rest of the wrapper's life: its settings
(:meth:`Mode.settings`, checked across ranks), the ranks the wrapper's engine averages over
(:meth:`Mode.engine_group`), construction (:meth:`Mode.attach`)
and the parameters it was given (:meth:`Mode.on_track`), ``join()`` (the last
round of a rank that leaves, :meth:`Mode.leaving`; what a rank that has joined does
after each shadow round, :meth:`Mode.shadow_step`; the end of the block,
:meth:`Mode.settle_after_join` and :meth:`Mode.broadcast_state`), checkpoints
(:meth:`Mode.state_dict`, :meth:`Mode.load_state_dict`), ``stats``
(:meth:`Mode.extra_state_bytes`) and the drift check (:meth:`Mode.kept_identical`: what
it keeps identical on every rank, and when; :meth:`Mode.whole_context`: over which ranks;
:meth:`Mode.ranks_training`: whether the ranks know at this point that none of them has
joined; :meth:`Mode.probe`: inside a join block, a round that asks who trains now). The
defaults do what synchronous training needs.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from .. import collectives
from ..compression import Compressor
from ..engine import GradientEngine
from ..engine.opening import open_engine
from ..planning import drift
from ..transport import stalls
from . import shards

__all__ = ["Mode", "ModeContext", "OuterFactory", "SyncVote"]

#: Builds DiLoCo's outer optimizer from the tensors it steps (the parameters at the last sync).
OuterFactory = Callable[[List[Tensor]], Optimizer]


class SyncVote(Protocol):
    """What a mode that syncs on its own schedule (local SGD) sees of fault tolerance.

    :class:`distopt.fault_tolerance.FaultTolerance` is one: each sync is a quorum of the
    replicas (opened by the sync's first collective, or by :meth:`enter_round`) and a
    commit vote before its result is applied.
    """

    #: The committed step count the quorum agreed on (after :meth:`enter_round`): the same on every replica.
    quorum_step: int

    def enter_round(self) -> None:
        """Start this sync's quorum and wait for it (once per sync)."""

    def commit(self, joined: bool = False) -> bool:
        """Vote: True if the sync's result may be applied. A replica behind loads a live peer's state here."""

    @property
    def healed_now(self) -> bool:
        """Whether the last :meth:`commit` loaded a live peer's state into this replica."""


class ModeContext:
    """What a mode sees of the wrapper it serves.

    It holds the wrapper's collaborators, not the wrapper: a dropped wrapper is freed
    at once (no reference cycle through its mode) and its hooks go quiet.

    Args:
        optimizer: the inner optimizer.
        engine: the gradient engine.
        params: every parameter the wrapper tracks, in tracking order (the wrapper's
            own list: it grows with ``add_param_group``).
        names: a name for each parameter, by ``id`` (from ``named_parameters``).
        process_group: the user's group (None: the default group).
        rank: this rank within the group.
        root_rank: the rank that broadcasts.
        reduce_op: ``"mean"`` or ``"sum"``.
        stall_warning: seconds before a wait warns, or None.
        stall_timeout: seconds before a wait raises, or None.
        reduce_for_step: reduces what backward did not, as ``step()`` must, and waits (the
            wrapper's, so that a subclass such as the Horovod front's can extend it).
        synchronize: the wrapper's ``synchronize()``.
        open_managed: opens an engine over the wrapper's torchft Manager with a compressor (or None),
            where the mode runs fault tolerance on a level of its own (:attr:`Mode.fault_tolerance_above`);
            else None (default).
        after_inner_step: called by a local step once the inner optimizer stepped (or skipped), before a
            sync that step may bring (:meth:`inner_step_taken`); None (default): nothing. ``distopt.Islands``
            hands the island's parameters there to its ranks that ran out of data inside ``join()``.
        inner_step: takes a local step's inner optimizer step, given the closure or None (:meth:`step_inner`);
            None (default): ``optimizer.step``. ``distopt.Islands(inside=distopt.ShardedState())`` steps this
            rank's shard there and shares it inside the island.
    """

    def __init__(self, *, optimizer: Optimizer, engine: GradientEngine, params: List[Tensor], names: Dict[int, str],
                 process_group: Optional[ProcessGroup], rank: int, root_rank: int, reduce_op: str,
                 stall_warning: Optional[float], stall_timeout: Optional[float],
                 reduce_for_step: Callable[[], None], synchronize: Callable[[], None],
                 open_managed: Optional[Callable[[Optional[Compressor]], GradientEngine]] = None,
                 after_inner_step: Optional[Callable[[], None]] = None,
                 inner_step: Optional[Callable[[Optional[Callable[[], Any]]], Any]] = None) -> None:
        self.optimizer = optimizer
        self.engine = engine
        self.params = params
        self.names = names
        self.process_group = process_group
        self.rank = rank
        self.root_rank = root_rank
        self.reduce_op = reduce_op
        self.stall_warning = stall_warning
        self.stall_timeout = stall_timeout
        self._reduce_for_step = reduce_for_step
        self._synchronize = synchronize
        self._open_managed = open_managed
        self._after_inner_step = after_inner_step
        self._inner_step = inner_step
        #: ``GradScaler``'s verdict for the step being taken (set by the wrapper's ``step()`` when the
        #: mode :attr:`Mode.handles_amp_scaling`): ``found_inf`` and the ``grad_scale`` the gradients
        #: still carry; both None without a ``GradScaler``.
        self.found_inf: Optional[Tensor] = None
        self.grad_scale: Optional[Tensor] = None

    @property
    def group(self) -> Optional[ProcessGroup]:
        """The private group the wrapper talks on (the user's group in a world of one)."""
        channel = self.engine.channel
        return channel.group if channel is not None else self.process_group

    @property
    def world_size(self) -> int:
        """Ranks in the group (under fault tolerance: the replicas of this step); the engine's
        :class:`~distopt.engine.state.World` holds it."""
        return self.engine.world_size

    @property
    def progress(self) -> Optional[stalls.Progress]:
        """This rank's position for the stall inspector (None in a world of one)."""
        return self.engine.progress

    @property
    def steps(self) -> int:
        """Steps taken; every rank's count travels with each round."""
        return self.engine.steps

    def set_steps(self, steps: int) -> None:
        """Set the step count (a checkpoint, or another rank's count at the end of a join block)."""
        self.engine.set_steps(steps)

    def step_inner(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """A local step's inner optimizer step (see ``inner_step``): ``optimizer.step(closure)`` unless the
        context's owner steps it otherwise. Returns what the inner optimizer's ``step`` returns."""
        if self._inner_step is not None:
            return self._inner_step(closure)
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def inner_step_taken(self) -> None:
        """A local step's inner optimizer stepped (or skipped it): what the context's owner does then, before
        the step's sync (see ``after_inner_step``)."""
        if self._after_inner_step is not None:
            self._after_inner_step()

    def reduce_for_step(self) -> None:
        """Reduce what backward did not, as ``step()`` must, and wait for it."""
        self._reduce_for_step()

    def synchronize(self) -> None:
        """Reduce now and wait, as the user's ``opt.synchronize()`` does."""
        self._synchronize()

    def open_engine(self, process_group: ProcessGroup, compressor: Optional[Compressor] = None) -> GradientEngine:
        """Open another engine, over ``process_group``, with the wrapper's settings: for a mode that
        averages over more than one group (e.g. every step inside a host, every H steps across hosts).

        It has a private group of its own (none in a group of one) and its own stall watch, so its
        collectives never pair with the wrapper's engine's. It averages what the mode gives it
        (:meth:`~distopt.engine.GradientEngine.launch_exchange` after
        :meth:`~distopt.engine.GradientEngine.track`); it reduces no gradient during backward (its
        parameters are not hooked). The mode owns it: it closes it (:meth:`~distopt.engine.GradientEngine.close`)
        when it is done with it. Every rank of ``process_group``, and only those, must call this, at the
        same point.

        Args:
            process_group: the ranks to average over; ranks are numbered within it.
            compressor: how its packs travel, or None: as they are (a compressor's state is one
                engine's: never the wrapper's own).

        Returns:
            The engine, with no parameter tracked yet.

        Raises:
            StallError: the group's other ranks did not open theirs within the stall timeout.
        """
        config = self.engine.config
        engine = open_engine(process_group, reduce_op=self.reduce_op, pack_threshold=config.pack_threshold,
                             compressor=compressor, sparse_as_dense=config.sparse_as_dense, backward_passes_per_step=1,
                             root_rank=0, stall_warning=self.stall_warning, stall_timeout=self.stall_timeout)
        engine.keep_gradients_local(True)
        return engine

    def open_managed_engine(self, compressor: Optional[Compressor] = None) -> GradientEngine:
        """Open the engine over the wrapper's torchft Manager (``fault_tolerance=``), for a mode that runs
        fault tolerance on a level of its own (:attr:`Mode.fault_tolerance_above`): its rounds are the
        quorum's, its sums travel on the manager's group, scaled by 1/participants, and it is the one
        the manager's commit vote follows. Like :meth:`open_engine`'s, it reduces no gradient during
        backward; the mode owns it.

        Args:
            compressor: how its packs travel, or None: as they are.

        Returns:
            The engine, with no parameter tracked yet (its world: the last quorum's participants).

        Raises:
            RuntimeError: the wrapper has no manager, or the mode does not run fault tolerance itself.
        """
        if self._open_managed is None:
            raise RuntimeError("open_managed_engine() needs a wrapper built with fault_tolerance= and a mode whose "
                               "fault_tolerance_above is True")
        engine = self._open_managed(compressor)
        engine.keep_gradients_local(True)
        return engine

    def name_of(self, p: Tensor, group: int, index: int) -> str:
        """The user's name for ``p``, else its place in the param groups."""
        return self.names.get(id(p), f"param_groups[{group}][{index}]")


class Mode:
    """Base class of the modes: what a wrapper does with gradients and at ``step()``.

    The wrapper holds its mode; every method is handed the :class:`ModeContext`.
    """

    #: Whether the engine averages gradients during backward.
    reduces_in_backward: bool = True
    #: Whether the mode takes ``GradScaler``'s verdict itself (torch's ``_step_supports_amp_scaling``):
    #: ``GradScaler.step`` then always calls ``step()``, with ``found_inf`` set.
    handles_amp_scaling: bool = False
    #: Whether the mode trains DTensor parameters (FSDP2's ``fully_shard``): the wrapper refuses them otherwise.
    takes_dtensors: bool = False

    #: Whether, under fault tolerance, the mode runs the torchft Manager on a level of its own, above the
    #: wrapper's engine: it opens the engine over the manager itself (:meth:`ModeContext.open_managed_engine`),
    #: while the wrapper's engine averages over :meth:`engine_group` as without fault tolerance (a group
    #: that fails, restarts and heals as one replica: :class:`distopt.Islands`' island). The wrapper still
    #: takes the quorum and the commit vote (per step, or per sync through :meth:`fault_tolerant`).
    fault_tolerance_above: bool = False

    #: How this mode takes the optimizer state sharded, for the error that ``shard_state=True`` given beside it
    #: gets (None: the error says to pass one or the other).
    shards_state_as: Optional[str] = None

    #: How the user asked for this mode, for error messages: ``mode=<its repr>`` unless the keyword
    #: shorthands built it (:mod:`distopt.modes.shorthands` then names the keywords).
    given_as: Optional[str] = None

    #: How the user spelled the mode's arguments, for error messages: constructor argument -> the keyword
    #: written (the shorthands' ``sync_every`` for ``every``, ...); an argument not in it is spelled as it is.
    spelling: Dict[str, str] = {}

    def describe(self) -> str:
        """How the user asked for this mode, as an error message names it."""
        return self.given_as or f"mode={self!r}"

    def named(self, argument: str) -> str:
        """``argument`` (a constructor argument's name) as the user wrote it."""
        return self.spelling.get(argument, argument)

    def check_compatible(self, *, optimizer: Optimizer, reduce_op: str, bcast_period: int,
                         fault_tolerant: bool) -> None:
        """Refuse the wrapper's arguments this mode cannot work with (called once, at construction).

        Args:
            optimizer: the inner optimizer.
            reduce_op: ``"mean"`` or ``"sum"``.
            bcast_period: the wrapper's ``bcast_period``.
            fault_tolerant: the wrapper was given a torchft ``Manager`` (``fault_tolerance=``).

        Raises:
            TypeError, ValueError: naming the argument, its value and the fix.
        """

    def bind(self, owner: object) -> None:
        """Serve ``owner`` (a wrapper): a mode holds one wrapper's state, as a compressor does, for the
        wrapper's life.

        Raises:
            ValueError: another wrapper that is still alive holds this mode.
        """
        held = getattr(self, "_owner", None)
        current = held() if held is not None else None
        if current is not None and current is not owner:
            raise ValueError(
                f"{self.describe()} already serves another DistributedOptimizer, and a mode holds one wrapper's "
                f"state (its step count, last-sync copies, shards); give each wrapper a mode of its own, e.g. "
                f"mode={type(self).__name__}(...) in each constructor call"
            )
        self._owner = weakref.ref(owner)

    def engine_group(self, process_group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
        """The ranks the wrapper's engine averages gradients over during backward (default: the wrapper's
        ``process_group`` itself).

        The wrapper calls it once, as it opens its engine, before any collective of its own: every rank
        of ``process_group`` at the same point, so a mode may build process groups here (every rank
        creating every group it takes part in, in the same order). The wrapper's rank, world size,
        ``root_rank``, its construction check and broadcasts, and :attr:`ModeContext.process_group` are
        then those of the group returned (:class:`distopt.Islands`: the ranks of this rank's island).

        Args:
            process_group: the wrapper's ``process_group`` (None: the default group).

        Returns:
            A group that holds this rank: ``process_group`` or a subgroup of it.
        """
        return process_group

    def fault_tolerant(self, vote: SyncVote) -> bool:
        """The wrapper trains under a torchft ``Manager``.

        Returns:
            True where the mode takes a quorum and a commit vote itself, once per sync (local SGD),
            through ``vote``; False where the wrapper takes them once per step (the default).
        """
        return False

    def step(self, ctx: ModeContext, closure: Optional[Callable[[], Any]]) -> Any:
        """Take one optimizer step; return what the inner optimizer's ``step`` returns.

        Args:
            ctx: the wrapper, as the mode sees it.
            closure: re-evaluates the model and returns the loss, or None.
        """
        raise NotImplementedError

    def on_track(self, ctx: ModeContext, params: List[Tensor]) -> None:
        """The wrapper took on ``params`` (at construction or ``add_param_group``), in tracking order."""

    def shadow_step(self, ctx: ModeContext) -> None:
        """As a rank that has joined: follow the others' step after a shadow round."""

    def settle_after_join(self, ctx: ModeContext, last: int, identical: bool) -> None:
        """At the end of a join block: unless the ranks are ``identical`` already (none stopped
        early), give every rank rank ``last``'s parameters and optimizer state."""
        if identical:
            return
        with torch.no_grad(), stalls.inspected(ctx.progress, "the parameter broadcast at the end of the join block"):
            collectives.broadcast_parameters(ctx.params, src=last, group=ctx.group)
        with stalls.inspected(ctx.progress, "the optimizer-state broadcast at the end of the join block"):
            collectives.broadcast_optimizer_state(ctx.optimizer, src=last, group=ctx.group)

    def state_dict(self, ctx: ModeContext) -> Dict[str, Any]:
        """What ``opt.state_dict()`` returns: the inner optimizer's, by default."""
        return ctx.optimizer.state_dict()

    def sharded_state_dict(self, ctx: ModeContext) -> Optional[Dict[str, Any]]:
        """This rank's shard of the optimizer state, or None for a mode that keeps all of it."""
        return None

    def load_state_dict(self, ctx: ModeContext, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, a plain optimizer's state dict, or a shard of a
        world of one (which is the whole state).

        Raises:
            ValueError: one rank's shard of a larger world (see :func:`distopt.modes.shards.whole`).
        """
        ctx.optimizer.load_state_dict(shards.whole(state_dict))

    def broadcast_optimizer_state(self, ctx: ModeContext, src: int) -> None:
        """Give every rank rank ``src``'s optimizer state, and the mode's own (:meth:`broadcast_state`).

        Raises:
            RuntimeError: the mode keeps different state on every rank by design.
        """
        with stalls.inspected(ctx.progress, "the optimizer-state broadcast"):
            collectives.broadcast_optimizer_state(ctx.optimizer, src=src, group=ctx.group)
        self.broadcast_state(ctx, src)

    def settings(self) -> Dict[str, Any]:
        """The mode's settings that decide which collectives run; checked to match across ranks.

        Keyed by the keyword a user writes (``sync_every``, ``shard_state``, ...), so that an error about
        ranks that differ names the argument; a mode without a keyword shorthand uses its own names.
        A setting another mode lacks counts as different.
        """
        return {}

    def attach(self, ctx: ModeContext) -> None:
        """Called once the wrapper is built (its parameters tracked and broadcast)."""

    def sync_now(self, ctx: ModeContext) -> None:
        """Bring every rank to the same parameters now, as a sync of this mode does (``opt.sync_now()``).

        Called on every rank at the same point, between two steps (never during backward). Modes
        that keep the ranks identical at every step have nothing to do (the default).

        Raises:
            RuntimeError: the mode cannot sync outside its schedule; the message says what to do.
        """

    def clip_grad_norm_(self, ctx: ModeContext, max_norm: float, norm_type: float) -> Tensor:
        """Clip the gradients of the parameters the optimizer steps by their total norm, as
        ``torch.nn.utils.clip_grad_norm_`` does over them (``opt.clip_grad_norm_``), and return that norm.

        The default clips every gradient this rank holds: each rank holds the whole averaged gradient.
        A mode whose ranks hold a part of it each (``shard_state="gradients"``) sums the parts' norms
        over the ranks, so every rank must call it.
        """
        params = [p for group in ctx.optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def finish_step(self, ctx: ModeContext) -> None:
        """Finish what the last step left in flight that the parameters depend on, and wait for it.

        A mode may let its step's communication run on after ``step()`` returns (sharded state shares
        the updated parameters until they are next used). The wrapper calls this where parameters are
        read or written outside a forward: ``opt.synchronize()``, ``opt.sync_now()``,
        ``broadcast_parameters()`` and ``close()``. The default has nothing in flight.
        """

    def joins_alone(self, ctx: ModeContext) -> bool:
        """Whether a rank that runs out of data must follow this wrapper's rounds alone, so that the wrapper
        cannot join in one block with other optimizers (``distopt.join(a, b)``): its :meth:`leaving` runs
        a loop of rounds of its own, while the other optimizers' rounds would wait for that rank.
        ``join()`` refuses such a block at once, on every rank. False by default.
        """
        return False

    def leaving(self, ctx: ModeContext) -> Optional[Callable[[], None]]:
        """A rank joins (runs out of data): launch its last contributing round, if it owes one.

        Returns:
            None, or a function that finishes the round launched (``join()`` calls it
            in place of finishing its first shadow round).
        """
        return None

    def broadcast_state(self, ctx: ModeContext, src: int) -> None:
        """Take rank ``src``'s mode state: at the end of a join block whose ranks ended apart, and in
        ``broadcast_optimizer_state()`` (after only the root loaded a checkpoint).

        Args:
            ctx: the wrapper, as the mode sees it.
            src: rank, in the wrapper's group, whose state every rank takes.
        """

    def synchronize(self, ctx: ModeContext) -> None:
        """The user's ``opt.synchronize()``, after the engine finished its round: reduce now what the mode
        reduces beyond it before ``step()`` (default: nothing; :class:`distopt.Islands` over FSDP2: the
        gradients' sum across the islands, so that clipping sees the global mean)."""

    def agree_on_drift(self, ctx: ModeContext, report: drift.DriftReport) -> drift.DriftReport:
        """The drift check's report for every rank, where :meth:`whole_context` holds only some of the ranks
        that must act on it alike (default: the report as it is; every rank was compared).

        Args:
            ctx: the wrapper, as the mode sees it.
            report: what the check over :meth:`whole_context` found on this rank.
        """
        return report

    def extra_state_bytes(self, ctx: ModeContext) -> int:
        """Bytes the mode holds besides the model and the inner optimizer (for ``stats``)."""
        return 0

    def ranks_training(self, ctx: ModeContext) -> Optional[int]:
        """How many ranks train on, as the ranks still training know it right after this step.

        A rank that has joined (inside ``join()``) takes part in the others' rounds only, never in a
        collective of theirs such as the drift check or a re-broadcast, and the others learn that it
        has joined from the control flags of a round (:attr:`distopt.planning.control.Totals.training`).
        So such a collective may run only where a round read in this step says that every rank trains on.
        Synchronous training reads one in every step.

        Returns:
            The count, the same on every rank still training; None where no round of this step tells
            (local SGD between two syncs): a rank may have joined unseen.
        """
        return ctx.engine.outcome.training

    def gathers_state(self, ctx: ModeContext) -> bool:
        """Whether :meth:`state_dict` is a collective of every rank (a sharded state's gather), so that inside a
        join block the wrapper first asks whether a rank has joined, which could not take part. Asked on every
        ``opt.state_dict()`` call; the default, False, is a state dict each rank makes alone."""
        return False

    def probe(self, ctx: ModeContext) -> Optional[int]:
        """Inside a join block, before a collective of the ranks still training (``check_drift()``): how many
        ranks train now, asked by a probe round (:meth:`distopt.engine.GradientEngine.probe`).

        :meth:`ranks_training` says what the last round said; a rank may have run out of data since, and
        then waits in a shadow round for the others' next round. The probe has that shadow round's shape
        (every pack of the plan, by default), so the joined rank takes part in it and the collective after
        it is not met by its shadow round. Every rank still training calls it at the same point.

        Returns:
            The count, the same on every rank still training; None where a probe round cannot tell
            (:class:`distopt.Islands`: a rank of another island waits in its own island's round).
        """
        return ctx.engine.probe().training

    def whole_context(self, ctx: ModeContext) -> ModeContext:
        """Every rank the wrapper serves (its ``process_group``), as a context: its group, progress, step
        count and ``root_rank``. The drift check compares :meth:`kept_identical` over it, and
        ``broadcast_parameters()`` (``bcast_period`` too) broadcasts from its root over it.

        The wrapper's own context, by default. A mode whose engine averages over part of the group
        (:meth:`engine_group`) returns one over the whole group (:class:`distopt.Islands`: every island).
        """
        return ctx

    def kept_identical(self, ctx: ModeContext, scheduled: bool) -> Optional[drift.Kept]:
        """What this mode keeps identical on every rank now, for the drift check to compare.

        Synchronous training keeps everything identical after every step: the parameters,
        the optimizer's state and its hyperparameters, and the step count.

        Args:
            ctx: the wrapper, as the mode sees it.
            scheduled: a periodic check (``check_every``) rather than ``opt.check_drift()``;
                a mode may put a periodic check off to a later step by returning None.

        Returns:
            What to compare, or None: nothing now (the wrapper tries again at the next step).
        """
        return drift.Kept(
            per_param=[[(drift.PARAMETER, p)] + state
                       for p, state in zip(ctx.params, drift.state_items(ctx.optimizer, ctx.params, "optimizer state"))],
            shared=drift.hyperparameter_items(ctx.optimizer) + [("the step count", ctx.steps)],
            what="the parameters, the optimizer state, its hyperparameters and the step count",
        )
