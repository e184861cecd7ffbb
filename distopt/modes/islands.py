"""Islands: synchronous training inside each host, any mode between the hosts.

The ranks are cut into *islands* of ``k`` ranks (one per host by default:
:mod:`distopt.planning.topology`), which talk over a fast link inside and a slow one between
them. Two levels, two engines:

- **inside** an island, *plain replicas*: the wrapper's own engine runs over the island's group
  (:meth:`Islands.engine_group`, the seam of :mod:`distopt.modes.base`), so its hooks, packs,
  ``no_sync()``, ``backward_passes_per_step``, ``synchronize()``, clipping and ``GradScaler``
  work exactly as synchronous training does on a group of ``k``: after backward every rank of an
  island holds the island's mean gradient.
- **across** the islands, the mode given as ``across=`` (:class:`~distopt.modes.synchronous.Synchronous`
  by default, or :class:`~distopt.modes.diloco.LocalSGD` / :class:`~distopt.modes.diloco.DiLoCo`, streaming
  too) runs on a second engine, over the *across group* of this rank's place (rank ``j`` of every island),
  which this mode opens (:meth:`~distopt.modes.base.ModeContext.open_engine`), owns and closes. The across
  mode's own code runs unchanged: it is handed a second :class:`~distopt.modes.base.ModeContext` whose
  engine and group are the across ones. ``compression=`` compresses that level only.

**Synchronous across is hierarchical.** Once the island's round settles (at the end of backward,
:meth:`~distopt.engine.GradientEngine.call_when_settled`), the island's mean gradients are laid out
as one flat vector per (device, dtype), cut into ``k`` slices; rank ``j`` of each island sums only
slice ``j`` across the islands (``1/k`` of the bytes, on every rank's own link), and each island then
gathers its slices. So ``.grad`` is the global mean when ``backward()`` returns, and every rank of
every island holds the same bits (compressed or not: every rank decodes the same sums). A parameter
without a gradient on some island is averaged with its zeros, and one without a gradient anywhere
keeps ``grad=None``, as in synchronous training; which is which travels in the presence flags of the
slice exchange, and only when some island lacks a gradient does a small exact sum of the parameters'
presence follow.

Local SGD and DiLoCo across: the islands step on their own mean gradients every step, and the across
mode syncs the parameters every ``every`` steps through the across engine (each rank of an island sends
the whole pseudo-gradient on its own link; the islands stay identical inside).

``join()`` works with synchronous training across: each island's mean counts by its contributors,
and a rank that has joined takes part in the sums across until no rank of any island contributes
(:meth:`Islands.leaving`). With local SGD or DiLoCo across an island is the across level's replica: a
rank that has joined stays its island's copy (it takes the island's parameters after each step while a
rank of the island trains) and syncs as a contributor; an island whose ranks have all joined leaves the
across level as a rank leaves flat local SGD (its progress once more, then zeros).

**FSDP2 inside** (:mod:`distopt.modes.island_shards`): where the optimizer's parameters are DTensors
sharded by FSDP2 over each rank's island, FSDP2 averages inside, the wrapper's engine runs over this rank
alone, and the across level syncs each rank's local shard over its across group (rank ``j`` of every
island holds the same shard): synchronous across in ``step()``, local SGD / DiLoCo on the shards.

**Sharded optimizer state inside** (``inside=ShardedState()``, :mod:`distopt.modes.island_sharding`): the
inside mode's own code runs with a view of the wrapper over the island (:meth:`Islands._inside`): rank ``j`` of
every island owns the same parameters, steps them (after the sum across, or as local SGD's inner step) and
shares them inside the island only. With ``ShardedState(gradients=True)`` the island's round reduce-scatters to
the owners, and with synchronous training across each rank sums only the gradients it owns with rank ``j`` of
every other island (:class:`~distopt.modes.island_sharding.OwnedGradients`), before the inside mode's own call at
the end of the round (the spread of a non-finite gradient over the island).

**Fault tolerance by island** (``fault_tolerance=manager``, :attr:`fault_tolerance_above`): each island is a
torchft replica group, the wrapper's ``process_group`` (one torchrun agent's workers); the manager's
group joins rank ``j`` of every island, so the across engine is the engine over the manager
(:meth:`~distopt.modes.base.ModeContext.open_managed_engine`), and the quorum and commit vote come per
step (synchronous across: the wrapper's) or per sync (local SGD / DiLoCo across, through the
:class:`~distopt.modes.base.SyncVote` the across mode takes). A rank that dies takes its island out;
its ranks restart together and rank ``j`` heals from rank ``j`` of a live island.

What is not supported yet raises at construction or at the call, naming what to do:
``join()`` with local SGD or DiLoCo across islands of one rank, under fault tolerance ``islands=``, ``compression=`` and
``join()``, a closure, the
across modes ``ShardedState`` (it goes in ``inside=``) and local SGD's ``warmup``, a frozen parameter made trainable after the
first cross-island sum (synchronous across; ``add_param_group()`` works); with FSDP2 inside, ``join()``,
``add_param_group()`` and ``broadcast_optimizer_state()``; with ``inside=ShardedState()``, FSDP2 parameters,
``fault_tolerance``, ``join()`` and ``broadcast_optimizer_state()``.

The drift check compares every rank of every island, and ``broadcast_parameters()`` (``bcast_period``)
and ``broadcast_optimizer_state()`` reach every rank of every island from island 0's root
(:meth:`Islands.whole_context`). The check compares, with synchronous training across, everything
synchronous training keeps alike; with local SGD or DiLoCo across, what the across mode keeps alike
(the parameters right after a sync, the last-sync copies between two).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from .. import collectives
from .. import compression as compression_module
from ..compression import Compressor
from ..engine import GradientEngine
from ..engine.packs import DIRECT_MIN_BYTES, Pack
from ..launching import placement
from ..planning import drift
from ..planning import topology as topologies
from ..planning.stats import StepStats
from ..planning.topology import Topology
from ..transport import private_groups, stalls
from . import island_sharding, island_shards
from .base import Mode, ModeContext, SyncVote
from .diloco import LocalSGD
from .island_shards import LocalShards
from .island_slices import SliceGroup, Slices
from .sharded import ShardedState
from .shorthands import settings_of
from .synchronous import Synchronous

__all__ = ["Islands", "STATE_KEY"]

#: The key of this mode's own state (the cross-island compressor's) in ``state_dict()``.
STATE_KEY = "distopt_islands"

_NOT_YET = "is not supported yet with distopt.Islands"


class Islands(Mode):
    """Synchronous training inside each island (host), and ``across`` between the islands.

    Inside an island the ranks are plain replicas: every step's gradients are averaged over the
    island during backward, uncompressed, as :class:`distopt.Synchronous` does on a group; or, where
    the parameters are DTensors of FSDP2 sharded over the island (``fully_shard(model,
    mesh=mesh["shard"])``, ``islands=mesh``), FSDP2 averages inside and the across mode syncs each
    rank's local shard with the same shard on the other islands. Between
    the islands runs ``across``: synchronous training (hierarchical: each rank of an island carries
    ``1/k`` of the gradient bytes across), or local SGD / DiLoCo / streaming DiLoCo, which sync the
    islands every ``every`` steps. ``compression`` compresses the cross-island level only. See
    docs/islands.md. A mode object serves one wrapper.

    Args:
        across: the mode between the islands, a mode object of its own: :class:`distopt.Synchronous`
            (the default), :class:`distopt.LocalSGD` or :class:`distopt.DiLoCo` (streaming too).
        islands: which ranks form an island: None, one island per host, from what torchrun and
            :func:`distopt.launch` set (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``); a 2-D
            ``DeviceMesh`` whose replicate dimension (named ``"replicate"``, else the first) runs across
            the islands; or a list of global rank lists, e.g. ``[[0, 1], [2, 3]]``. The islands must be of
            equal size and cover the wrapper's ``process_group``, and every rank must pass the same.
        compression: how the cross-island level travels: a name of ``distopt.compression.NAMES``
            (``"int8"``, ...) or a :class:`distopt.compression.Compressor` (default: None, as they are).
            The wrapper's own ``compression=`` would compress inside the islands and is refused.
        inside: what the ranks of an island keep: None (the default), plain replicas, each with the whole
            optimizer state; or :class:`distopt.ShardedState` (``share=`` as there), the inner optimizer's state
            sharded over the island's ``k`` ranks (rank ``j`` of every island owns the same parameters, steps
            them, and shares them inside its island only): about ``1/k`` of the state per rank, training as
            unsharded; ``ShardedState(gradients=True)`` shards the gradients too (ZeRO-2: each rank sums only its
            owned gradients across). Not with FSDP2 parameters (which shard the state already), ``fault_tolerance``
            or ``join()``.

    ``broadcast_parameters()``, ``bcast_period`` and ``broadcast_optimizer_state()`` reach every rank
    of every island from island 0's ``root_rank``; the drift check compares every rank of every island.

    Raises:
        TypeError: ``across`` or ``inside`` is not a mode object, or ``islands`` is neither None, a DeviceMesh nor
            a list of rank lists; when the wrapper is built, an island of the wrong form.
        ValueError: an unknown ``compression``; ``across`` a mode not supported across islands yet (``ShardedState``:
            pass it as ``inside``); ``inside`` neither ``ShardedState`` nor ``Synchronous``;
            when the wrapper is built, islands that overlap, differ in size, do not cover the group, or
            differ between ranks (on every rank alike, before any group is built); DTensor parameters over
            a 2-D mesh (HSDP), over other ranks than the island, or mixed with plain ones, or with ``inside=ShardedState()``.

    Example::

        >>> # torchrun --nnodes 2 --nproc-per-node 4 train.py: 2 islands of 4 ranks, one per host
        >>> opt = distopt.DistributedOptimizer(
        ...     torch.optim.AdamW(model.parameters(), lr=3e-4),
        ...     mode=distopt.Islands(across=distopt.DiLoCo(every=64, outer=lambda ps: torch.optim.SGD(
        ...         ps, lr=0.7, momentum=0.9, nesterov=True)), compression="int8"))
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()   # averaged inside the host
        ...     opt.step()                        # every 64 steps the hosts sync
    """

    reduces_in_backward = True
    fault_tolerance_above = True  # under fault tolerance a replica is an island; the manager joins them
    shards_state_as = ("mode=distopt.Islands(across=..., inside=distopt.ShardedState()), which shards the optimizer "
                       "state over each island's ranks (inside=distopt.ShardedState(gradients=True): the gradients too)")

    def __init__(self, across: Optional[Mode] = None, *, islands: Any = None,
                 compression: Union[str, Compressor, None] = None, inside: Optional[Mode] = None) -> None:
        across = Synchronous() if across is None else across
        if not isinstance(across, Mode):
            raise TypeError(f"across must be a distopt mode object, e.g. across=distopt.DiLoCo(every=64, outer=...) "
                            f"or across=distopt.Synchronous(), got {type(across).__name__}")
        if isinstance(across, ShardedState):
            raise ValueError(
                f"across={across!r} {_NOT_YET}: the optimizer state is sharded inside an island, over its ranks "
                "(each island holds the whole state, rank j of every island the same shard); pass "
                f"inside={across!r}, with across=distopt.Synchronous() (the default) or another across mode")
        if isinstance(across, Islands) or not isinstance(across, (Synchronous, LocalSGD)):
            raise ValueError(
                f"across={across!r} {_NOT_YET}: across the islands run distopt.Synchronous(), distopt.LocalSGD(...) "
                "or distopt.DiLoCo(...) (streaming too); pass one of those")
        if isinstance(across, LocalSGD) and across.local_warmup:
            raise ValueError(
                f"across={across!r}: warmup={across.local_warmup} {_NOT_YET} (the warm-up steps would be synchronous "
                "across the islands); pass warmup=0, or train the first steps with another wrapper in "
                "Islands(across=distopt.Synchronous())")
        if not (islands is None or _is_mesh(islands) or isinstance(islands, (list, tuple))):
            raise TypeError(f"islands must be None (one island per host), a DeviceMesh or a list of rank lists, e.g. "
                            f"islands=[[0, 1], [2, 3]], got {type(islands).__name__}")
        self.across = across
        self.islands = islands
        #: ``inside=``: None for plain replicas, or the :class:`ShardedState` that shards the inner optimizer's
        #: state over the island's ranks (:mod:`distopt.modes.island_sharding`).
        self.inside: Optional[ShardedState] = island_sharding.inside_mode(inside)
        self._inner: Optional[ModeContext] = None  # inside=ShardedState(): its view, the island with the sum across
        self.compression = None if compression in (None, "none") else compression
        self.compressor: Optional[Compressor] = compression_module.resolve(compression)
        #: The islands, once the wrapper was built (:meth:`engine_group`).
        self.topology: Optional[Topology] = None
        self._island_group: Optional[ProcessGroup] = None
        self._across_group: Optional[ProcessGroup] = None
        self._across_source = 0  # island 0's rank in this rank's across group
        self._engine: Optional[GradientEngine] = None  # the across engine, this mode's own
        self._ctx: Optional[ModeContext] = None  # the across mode's view: the across engine and group
        self._whole: Optional[ProcessGroup] = None  # the wrapper's process_group, which the islands divide
        self._world: Optional[ModeContext] = None  # the drift check's view: every rank of every island
        self._bcast_period = 0
        self._tracked = 0  # the wrapper's parameters the across level took on
        self._slices: Optional[Slices] = None  # synchronous across: the flat layout of the gradients
        # Synchronous across with inside=ShardedState(gradients=True): the owned gradients it sums across.
        self._owned: Optional[island_sharding.OwnedGradients] = None
        self._inside_settled: Optional[Callable[[], None]] = None  # the inside mode's own call when a round settles
        self._crossed_at = -1  # the island round whose gradients were summed across last
        self._extra_bytes = 0  # the last sum across: its exact sums beside the slices (presence, contributors)
        self._contributors: Optional[int] = None  # in a join block: the last round's contributors, every island's
        self._steps_after_join: Optional[int] = None  # the step count every rank takes after a join block
        self._meshes: Optional[List[Tuple[int, ...]]] = None  # FSDP2 inside: the ranks its parameters shard over
        self._shards: Optional[LocalShards] = None  # FSDP2 inside: the local shards the across level syncs
        self._shards_crossed_at = -1  # FSDP2 inside: the step whose gradients were summed across last
        self._fault_tolerant = False  # fault_tolerance=: the island is a replica group, the manager joins them
        self._vote: Optional[SyncVote] = None  # the wrapper's torchft controller, under fault tolerance
        self._across_join: Optional[Tuple[bool, bool]] = None  # local SGD across in join(): what leaving restores
        self._started_alike = False  # under fault tolerance: the island took its root's state after step 0

    # ------------------------------------------------------------------ the public object

    @property
    def _sums_gradients(self) -> bool:
        """Whether the across mode averages every step's gradients (synchronous training across), asked of the
        mode itself; otherwise it steps locally and syncs parameters on its own schedule (local SGD, DiLoCo)."""
        return self.across.reduces_in_backward


    def __repr__(self) -> str:
        shown = [f"across={self.across!r}"]
        if self.islands is not None:
            shown.append("islands=<DeviceMesh>" if _is_mesh(self.islands) else f"islands={self.islands!r}")
        if self.compression is not None:
            shown.append(f"compression={self.compression!r}")
        if self.inside is not None:
            shown.append(f"inside={self.inside!r}")
        return f"Islands({', '.join(shown)})"

    @property
    def handles_amp_scaling(self) -> bool:  # type: ignore[override]
        """As the across mode: local SGD takes ``GradScaler``'s verdict itself, since islands differ."""
        return self.across.handles_amp_scaling

    @property
    def takes_dtensors(self) -> bool:  # type: ignore[override]
        """Whether FSDP2 shards the model inside the islands (the optimizer's parameters are DTensors)."""
        return self._meshes is not None

    @property
    def across_stats(self) -> StepStats:
        """What the last step put on the cross-island link, per rank: the across engine's last round
        (``bytes``, ``packs``, ``all_reduces``), plus the exact presence sum when one ran."""
        if self._engine is None:
            return StepStats()
        stats = self._engine.stats
        return dataclasses.replace(stats, bytes=stats.bytes + self._extra_bytes)

    def settings(self) -> Dict[str, Any]:
        return {
            "islands": None if self.topology is None else self.topology.describe(),
            "islands_across": {**settings_of(self.across)},
            "islands_compression": None if self.compressor is None else self.compressor.settings(),
            "islands_inside": ("fsdp2" if self._meshes is not None else "replicas" if self.inside is None
                               else f"sharded_state(share={self.inside.share!r}, gradients={self.inside.gradients})"),
        }

    def check_compatible(self, *, optimizer: Optimizer, reduce_op: str, bcast_period: int,
                         fault_tolerant: bool) -> None:
        if fault_tolerant:
            self._check_fault_tolerant()
        self._bcast_period = bcast_period
        self._meshes = island_shards.mesh_ranks_of(optimizer, {})  # before any collective: every rank alike
        if fault_tolerant and self._meshes is not None:
            raise ValueError(
                f"fault_tolerance with FSDP2 inside the islands {_NOT_YET}: train FSDP2 islands without "
                "fault_tolerance, or plain replicas inside (no fully_shard) under fault_tolerance")
        self.across.check_compatible(optimizer=optimizer, reduce_op=reduce_op, bcast_period=bcast_period,
                                     fault_tolerant=fault_tolerant)
        if self.inside is not None:
            island_sharding.check_compatible(self.inside, optimizer=optimizer, reduce_op=reduce_op,
                                             bcast_period=bcast_period, fault_tolerant=fault_tolerant,
                                             fsdp2=self._meshes is not None)

    # ------------------------------------------------------------------ fault tolerance: an island per replica

    def _check_fault_tolerant(self) -> None:
        """Under ``fault_tolerance=`` an island is a torchft replica group: the wrapper's ``process_group``
        (the ranks of one torchrun agent), and the manager joins the islands.

        Raises:
            ValueError: ``islands=`` given (the replica groups are the islands), or ``compression=`` across.
        """
        if self.islands is not None:
            raise ValueError(
                "islands= cannot be combined with fault_tolerance: there each island is a torchft replica group, the "
                "processes of one torchrun agent (python -m distopt.fault_tolerance.launch --replicas N "
                "--nproc-per-node K), and the manager joins the islands; leave islands unset")
        if self.compressor is not None:
            raise ValueError(
                f"compression={self.compression!r} across the islands {_NOT_YET} under fault_tolerance; leave "
                "compression unset on Islands")
        self._fault_tolerant = True

    def _same_start(self, ctx: ModeContext) -> None:
        """Under fault tolerance, after this process's first step (or sync), if its quorum was the job's
        first (step 0): give the island its rank 0's parameters, optimizer state and across state.

        At step 0 torchft heals rank ``j`` of every island but one from rank ``j`` of a primary island that
        it picks by ``j`` (``init_sync``): with different initialisations the ranks of one island would then
        hold different islands' states. Rank 0's primary gives every island the same. Later heals need
        nothing: every live island is the same on all its ranks, and rank ``j`` heals from rank ``j``.
        """
        if self._vote is None or self._started_alike:
            return
        self._started_alike = True
        if self._vote.quorum_step != 0 or ctx.world_size == 1:
            return
        with torch.no_grad(), stalls.inspected(ctx.progress, "the island's broadcast after the first step"):
            collectives.broadcast_parameters(ctx.params, src=0, group=ctx.group)
        self.broadcast_optimizer_state(ctx, 0)  # the island's root's, and the across mode's state

    def fault_tolerant(self, vote: SyncVote) -> bool:
        """The manager serves the across level: a quorum and a commit vote per step with synchronous training
        across (the wrapper takes them), per sync with local SGD or DiLoCo across (the across mode does)."""
        self._vote = vote
        return self.across.fault_tolerant(vote)

    def bind(self, owner: object) -> None:
        super().bind(owner)
        self.across.bind(owner)
        if self.inside is not None:
            self.inside.bind(owner)

    # ------------------------------------------------------------------ the topology and the groups

    def engine_group(self, process_group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
        """Agree on the islands across the whole group, build the island and across groups, and
        return this rank's island: the wrapper's engine averages over it.

        Raises:
            TypeError, ValueError: on every rank alike, the first rank's error or where two ranks'
                islands differ, before any group is built.
        """
        if not collectives.is_distributed():
            self.topology = Topology(((0,),))
            return process_group
        if self._fault_tolerant:  # the island is the whole group; the manager joins the islands
            self.topology = Topology((tuple(range(collectives.get_world_size(process_group))),))
            self._whole = process_group
            return process_group
        group = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        mine: Any
        try:
            mine = self._own_view(ranks)
        except (TypeError, ValueError) as exc:
            mine = (type(exc).__name__, str(exc))
        with stalls.inspected(None, "the comparison of the islands"):
            everyone = collectives.all_gather_object((mine, placement.this_process(), self._meshes),
                                                     group=process_group)
        views: List[Any] = []
        for view, _, _ in everyone:
            if view == "hosts":
                try:
                    view = topologies.from_hosts([place for _, place, _ in everyone], ranks)
                except ValueError as exc:
                    view = ("ValueError", str(exc))
            views.append(view)
        refused = next(((rank, v) for rank, v in enumerate(views) if isinstance(v, tuple)
                        and not isinstance(v, Topology)), None)
        if refused is not None:
            rank, (kind, message) = refused
            error = TypeError if kind == "TypeError" else ValueError
            raise error(message if len(views) == 1 else f"rank {rank}: {message}")
        why = topologies.disagreement(views)
        if why is not None:
            raise ValueError(why)
        topology = views[0]
        why = island_shards.mesh_disagreement([meshes for _, _, meshes in everyone], ranks, topology.islands)
        if why is not None:
            raise ValueError(why)
        me = dist.get_rank()
        place = topology.place_of(me)
        island = topology.islands[topology.island_of(me)]
        across = topology.across()[place]
        self._island_group, self._across_group = _subgroups(topology, island, across, ranks, group)
        self._across_source = sorted(across).index(topology.islands[0][place])
        self._whole = process_group
        self.topology = topology
        if self._meshes is not None:  # FSDP2 averages inside the island: the wrapper's engine has this rank alone
            return _alone(me, ranks, group)
        return self._island_group if self._island_group is not group else process_group

    def _own_view(self, ranks: List[int]) -> Any:
        """This rank's islands from its own arguments ("hosts": from every rank's place, once gathered)."""
        if self.islands is None:
            return "hosts"
        if _is_mesh(self.islands):
            mesh = self.islands
            return topologies.from_mesh(mesh.mesh.tolist(), mesh.mesh_dim_names, ranks)
        return topologies.from_groups(self.islands, ranks)

    # ------------------------------------------------------------------ construction

    def attach(self, ctx: ModeContext) -> None:
        if ctx.engine.config.compressor is not None:
            raise ValueError(
                "the wrapper's compression= would compress inside the islands, which stay uncompressed; pass it to "
                "the mode instead: mode=distopt.Islands(across=..., compression=...) compresses the cross-island level")
        topology = self.topology
        if (self._sums_gradients and topology is not None and topology.size == 1
                and topology.count > 1):
            raise ValueError(
                f"islands={topology.describe()} are of one rank each, and across=Synchronous() then is flat "
                "synchronous training: use mode=distopt.Synchronous() (or islands of several ranks)")
        if self._fault_tolerant:
            self._engine = ctx.open_managed_engine(self.compressor)
        else:
            self._engine = ctx.open_engine(self._across_group, self.compressor)
        engine = self._engine
        weakref.finalize(self, engine.close)  # the mode owns it: closed when the mode (with its wrapper) goes
        across_rank = 0 if self._fault_tolerant else collectives.get_rank(self._across_group)
        if self._meshes is not None:
            self._shards = LocalShards(ctx.params)
        self._ctx = ModeContext(
            optimizer=ctx.optimizer, engine=engine, params=self._across_params(ctx), names=ctx.names,
            process_group=self._across_group, rank=across_rank, root_rank=self._across_source,
            reduce_op=ctx.reduce_op, stall_warning=ctx.stall_warning, stall_timeout=ctx.stall_timeout,
            reduce_for_step=_weakly(self, lambda mode: mode._reduce_across(ctx)),
            synchronize=_weakly(self, lambda mode: mode._reduce_across(ctx)),
            after_inner_step=_weakly(self, lambda mode: mode._hand_island_parameters(ctx)),
            inner_step=None if self.inside is None else _stepping_inside(self, ctx))
        if topology is not None and topology.size > 1 and self._shards is None and not self._fault_tolerant:
            self._world = self._open_world(ctx)
        # Under fault tolerance the across world is 1 until a quorum, so this compares nothing: a rank that
        # heals compares its settings with its live peer's instead, as without islands.
        self._agree_across(ctx)
        if self._bcast_period != -1 and engine.world_size > 1 and ctx.params:
            with torch.no_grad(), stalls.inspected(engine.progress, "the broadcast of island 0's parameters"):
                collectives.broadcast_parameters(self._ctx.params, src=self._across_source, group=self._ctx.group)
        crosses_after_round = False
        if self._shards is not None:
            self._track_across(ctx)  # synchronous too: the local gradients travel as they are, no slices
        elif self._sums_gradients and self.inside is not None and self.inside.gradients:
            # Each rank sums the gradients it owns with rank j of every island, as they are: no slices.
            self._owned = island_sharding.OwnedGradients(self.inside)
            self._owned.take_on(engine, ctx.params, ctx.names)
            crosses_after_round = engine.world_size > 1
        elif self._sums_gradients:
            self._warn_if_flat_slices_gain_nothing(ctx)
            crosses_after_round = engine.world_size > 1 or self._fault_tolerant
        else:
            self._track_across(ctx)
        self._ctx.set_steps(ctx.steps)
        self.across.attach(self._ctx)
        if self.inside is not None:
            self.inside.attach(self._inside(ctx))
        if crosses_after_round:
            # After the inside mode's attach, which sets its own call on the island's engine (ShardedState: the
            # spread of a non-finite gradient, the hand-over of a joined rank's shard): that call runs after the
            # sum across, on the global means.
            self._inside_settled = ctx.engine.call_when_settled(
                _weakly(self, lambda mode: mode._cross_after_round(ctx)))

    def _across_params(self, ctx: ModeContext) -> List[Tensor]:
        """What the across level syncs: the wrapper's parameters, or with FSDP2 inside their local shards'
        aliases (:class:`~distopt.modes.island_shards.LocalShards`), pointed at the shards as they are now."""
        if self._shards is None:
            return ctx.params
        if len(ctx.params) != len(self._shards.params):
            raise RuntimeError(
                f"add_param_group() with FSDP2 inside the islands {_NOT_YET}: the parameters added would not be "
                "synced across the islands; give the optimizer every parameter group before building the "
                "DistributedOptimizer")
        return self._shards.refresh()

    def _open_world(self, ctx: ModeContext) -> ModeContext:
        """A context over every rank of every island, rooted at island 0's root (an engine of its own, which
        tracks nothing: its private group and its stall watch)."""
        engine = ctx.open_engine(self._whole)
        weakref.finalize(self, engine.close)
        return ModeContext(
            optimizer=ctx.optimizer, engine=engine, params=ctx.params, names=ctx.names, process_group=self._whole,
            rank=collectives.get_rank(self._whole), root_rank=self._whole_rank(ctx.root_rank), reduce_op=ctx.reduce_op,
            stall_warning=ctx.stall_warning, stall_timeout=ctx.stall_timeout,
            reduce_for_step=_nothing, synchronize=_nothing)

    def _whole_rank(self, island_rank: int) -> int:
        """Island 0's rank ``island_rank``, numbered in the wrapper's ``process_group``."""
        whole = self._whole if self._whole is not None else dist.group.WORLD
        return dist.get_group_rank(whole, self.topology.islands[0][island_rank])

    def _warn_if_flat_slices_gain_nothing(self, ctx: ModeContext) -> None:
        """A compressor of matrices (PowerSGD) sends the flat slices of the hierarchical sum as they are."""
        trainable = [p for p in ctx.params if p.requires_grad]
        if self.compressor is None or not trainable or self.topology is None:
            return
        dtype = trainable[0].dtype
        flat = torch.Size([-(-sum(p.numel() for p in trainable) // self.topology.size)])
        if (self.compressor.wire_fraction([flat], dtype) >= 1.0
                and self.compressor.wire_fraction([p.shape for p in trainable], dtype) < 1.0):
            warnings.warn(
                f"compression={self.compression!r} gains nothing across the islands with across=Synchronous(): the "
                "hierarchical sum sends each rank's flat slice of the gradients, and this compressor compresses "
                "matrices only, so the slices travel as they are. Use a compressor of flat values across "
                "(compression='int8', 'topk', 'sign'), or across=distopt.DiLoCo(...)/LocalSGD(...), whose "
                "pseudo-gradients keep their shapes", RuntimeWarning, stacklevel=2)

    def _agree_across(self, ctx: ModeContext) -> None:
        """Every island built the same wrapper: compare what decides the across level's collectives
        (the islands agree inside already: the wrapper compared its settings there).

        The pack size is island 0's (``pack_threshold="auto"`` times each island's link); with local SGD or
        DiLoCo across, uncompressed, at most ``DIRECT_MIN_BYTES``, so that large parameters need no pack buffer.

        Raises:
            ValueError: two islands differ, naming what.
        """
        engine = self._engine
        if engine.world_size == 1:
            return
        mine = {
            "settings": self.settings(),
            "reduce_op": ctx.reduce_op,
            "backward_passes_per_step": ctx.engine.backward_passes_per_step,
            "parameters": [(ctx.names.get(id(p)), tuple(p.shape), str(p.dtype), p.requires_grad)
                           for p in ctx.params],
            "pack_threshold": ctx.engine.config.pack_threshold,
        }
        with stalls.inspected(engine.progress, "the check that every island built the same optimizer"):
            everyone = collectives.all_gather_object(mine, group=self._ctx.group)
        first = everyone[self._across_source]
        ranks = dist.get_process_group_ranks(self._ctx.group)
        for rank, theirs in enumerate(everyone):
            island = f"island {self.topology.island_of(ranks[rank])} (global rank {ranks[rank]})"
            for key in ("settings", "reduce_op", "backward_passes_per_step", "parameters"):
                if theirs[key] == first[key]:
                    continue
                if key == "parameters":
                    ours, other = first[key], theirs[key]
                    i = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
                    what = (f"parameter {i} is {_param(ours, i)} on island 0 and {_param(other, i)} on {island}"
                            if i < max(len(ours), len(other)) else "")
                else:
                    what = f"{key} is {first[key]!r} on island 0 and {theirs[key]!r} on {island}"
                raise ValueError(
                    f"the islands built different optimizers: {what}; build the same model, optimizer and "
                    "DistributedOptimizer arguments on every rank")
        threshold = first["pack_threshold"]
        if not self._sums_gradients and self.compressor is None:
            # Local SGD across sends the pseudo-gradients every few steps only, so packs buy little there,
            # and a pack's buffer would hold a second copy of its parameters for good: a parameter of
            # DIRECT_MIN_BYTES or more travels in a pack of its own, without a buffer, and a whole-model sync
            # sends it from the parameter's own storage (LocalSGDMode._filler).
            threshold = min(threshold, DIRECT_MIN_BYTES)
        engine.reconfigure(pack_threshold=threshold)

    def _track_across(self, ctx: ModeContext) -> List[Tensor]:
        """The across engine takes on the wrapper's parameters it lacks (local SGD exchanges them)."""
        params = self._ctx.params
        new = params[self._tracked:]
        if new:
            self._engine.track(new, [ctx.names.get(id(p), f"parameter {self._tracked + i}")
                                     for i, p in enumerate(ctx.params[self._tracked:])])
            self._tracked = len(params)
        return new

    def on_track(self, ctx: ModeContext, params: List[Tensor]) -> None:
        """``add_param_group()`` (every rank, at the same point): the islands compare the parameters again,
        and the across level takes the new ones on (synchronous: slices of their own). With
        ``inside=ShardedState()`` the island's ranks divide the new parameters' state between them."""
        if self.inside is not None:  # ownership over the island's ranks, the same on every island
            self.inside.on_track(self._inside(ctx), params)
        if self._engine is None:  # at construction: attach() takes them on
            return
        self._agree_across(ctx)
        if self._owned is not None:  # the new parameters this rank owns, the same on rank j of every island
            self._owned.take_on(self._engine, ctx.params, ctx.names)
            return
        if self._sums_gradients:
            if self._slices is not None:
                self._lay_out(ctx, [i for i, p in enumerate(ctx.params) if p.requires_grad
                                    and i not in self._slices.members])
            return
        new = self._track_across(ctx)
        if new:
            self.across.on_track(self._ctx, new)

    # ------------------------------------------------------------------ the step

    def step(self, ctx: ModeContext, closure: Optional[Callable[[], Any]]) -> Any:
        self._refuse_join(ctx, "a step inside join()")
        self._steps_from_join(ctx)
        if closure is not None:
            raise RuntimeError(f"step(closure) {_NOT_YET}; call step() after backward()")
        ctx.reduce_for_step()  # the island's round, if it was left pending
        self._join_across(ctx)
        self._across_params(ctx)
        across = self._ctx
        across.set_steps(ctx.steps)
        across.found_inf, across.grad_scale = ctx.found_inf, ctx.grad_scale
        try:
            if self.inside is not None and self._sums_gradients:
                # Synchronous across has nothing to do in the step (the sum across ran where the island's round
                # settled): the inside mode steps this rank's shard of the global mean and shares it in the island.
                loss = self.inside.step(self._inside(ctx), None)
            else:  # local SGD across steps the inside mode through the across context (step_inner)
                loss = self.across.step(across, None)
        finally:
            across.found_inf = across.grad_scale = None
            self._engine.after_step()  # as the wrapper does for its own engine: the next round starts
        self._same_start(ctx)
        return loss

    def finish_step(self, ctx: ModeContext) -> None:
        """With ``inside=ShardedState(share="background")``: wait until every rank of the island holds the
        parameters its other ranks stepped."""
        if self.inside is not None:
            self.inside.finish_step(self._inside(ctx))

    def _inside(self, ctx: ModeContext) -> ModeContext:
        """The inside mode's view (``inside=ShardedState()``): the wrapper's, over the island (its engine, group,
        rank and world: the shards and their share stay inside the island), but its reduction before the step is
        the island's round and then, with synchronous training across, the sum across the islands."""
        if self._inner is None:
            self._inner = ModeContext(
                optimizer=ctx.optimizer, engine=ctx.engine, params=ctx.params, names=ctx.names,
                process_group=ctx.process_group, rank=ctx.rank, root_rank=ctx.root_rank, reduce_op=ctx.reduce_op,
                stall_warning=ctx.stall_warning, stall_timeout=ctx.stall_timeout,
                reduce_for_step=_weakly(self, lambda mode: mode._reduce_across(ctx)),
                synchronize=_weakly(self, lambda mode: mode._reduce_across(ctx)))
        return self._inner

    def sync_now(self, ctx: ModeContext) -> None:
        self._across_params(ctx)
        self._ctx.set_steps(ctx.steps)
        self.across.sync_now(self._ctx)

    def _refuse_join(self, ctx: ModeContext, what: str) -> None:
        if ctx.engine.join.in_block and self.inside is not None:
            raise RuntimeError(
                f"{what}: join() with inside={self.inside!r} {_NOT_YET}; give every rank the same number of "
                "batches (e.g. drop the last, uneven ones with DistributedSampler(drop_last=True)), or train plain "
                "replicas inside (no inside=) in a join block")
        if ctx.engine.join.in_block and self._shards is not None:
            raise RuntimeError(
                f"{what}: join() with FSDP2 inside the islands {_NOT_YET}; give every rank the same number of "
                "batches (e.g. drop the last, uneven ones with DistributedSampler(drop_last=True))")
        if ctx.engine.join.in_block and self._fault_tolerant:
            raise RuntimeError(
                f"{what}: join() {_NOT_YET} under fault_tolerance; give every rank the same number of batches (e.g. "
                "drop the last, uneven ones with DistributedSampler(drop_last=True))")
        if ctx.engine.join.in_block and not self._sums_gradients and ctx.world_size == 1:
            raise RuntimeError(
                f"{what}: join() with islands of one rank {_NOT_YET}(across={self.across!r}); that is flat "
                f"training: use mode={self.across!r} without Islands, whose join() works, or islands of several "
                "ranks")

    # ------------------------------------------------------------------ join()

    def leaving(self, ctx: ModeContext) -> Optional[Callable[[], None]]:
        """A rank ran out of data: it shadows its island's rounds until no rank of any island contributes.

        With synchronous training across it takes part in every sum across with its island's values
        (:meth:`_shadow_until_every_island_joined`); with local SGD or DiLoCo across it follows its island's
        steps and syncs as long as a rank of the island trains, then sends the island's last progress and
        shadows the other islands' syncs (:meth:`_follow_until_every_island_joined`).

        The wrapper's own loop ends when no rank of the island contributes; an island whose ranks have all
        joined must still take part across while another island trains, so this rank's loop runs here,
        in place of the wrapper's first shadow round, and ends when every island's has."""
        self._refuse_join(ctx, "a rank ran out of data")
        if self._engine is None or self._engine.world_size == 1:
            return None  # one island: the wrapper's join is the whole story
        if not self._sums_gradients:
            return _weakly(self, lambda mode: mode._follow_until_every_island_joined(ctx))
        return _weakly(self, lambda mode: mode._shadow_until_every_island_joined(ctx))

    def joins_alone(self, ctx: ModeContext) -> bool:
        """A rank that has joined follows the islands' rounds in a loop of its own (:meth:`leaving`)."""
        return self._engine is not None and self._engine.world_size > 1

    def _shadow_until_every_island_joined(self, ctx: ModeContext) -> None:
        engine = ctx.engine
        while True:
            engine.shadow_launch()
            engine.shadow_finish()  # the round settles: its sum across counts every island's contributors
            if not self._contributors:
                return

    def _follow_until_every_island_joined(self, ctx: ModeContext) -> None:
        """Local SGD or DiLoCo across: this rank ran out of data. An island is the across level's replica, so
        while a rank of its island trains, this rank is the island's copy in its across group: it shadows the
        island's rounds (zeros, not counted in the island's mean) and, after each round with contributors,
        counts the step the island took, takes the island's parameters (:meth:`_hand_island_parameters`) and
        syncs with the other islands when a sync is due, as a contributor. Once no rank of the island trains,
        the island leaves the across level as a rank leaves flat local SGD: its progress since the last sync
        once more, as a contributor for the last time (``across.leaving``), then zeros in the other islands'
        syncs, which average over the islands still training (or over all, with ``divide_by_world``), until no
        island trains."""
        island, across = ctx.engine, self._ctx
        self._join_across(ctx)
        while True:
            island.shadow_launch()
            if not island.shadow_finish():
                break  # no rank of the island trains any more
            self._across_params(ctx)
            across.set_steps(ctx.steps)
            try:
                self.across.follow_step(across)
            finally:
                self._engine.after_step()
            ctx.set_steps(ctx.steps + 1)
        engine = self._engine
        across.set_steps(ctx.steps)
        final = self.across.leaving(across)
        while True:
            if final is None:
                engine.shadow_launch()
            contributors = engine.shadow_finish(final)
            final = None
            if not contributors:
                return
            self.across.shadow_step(across)

    def _join_across(self, ctx: ModeContext) -> None:
        """Local SGD or DiLoCo across, inside ``join()``: the across engine's syncs count their contributors
        too (the islands still training; ``divide_by_world`` as the block says), from the block's first step."""
        island = ctx.engine
        if self._sums_gradients or not island.join.in_block or self._across_join is not None:
            return
        self._across_join = self._engine.enter_join(island.join.divide_by_world)

    def _hand_island_parameters(self, ctx: ModeContext) -> None:
        """After a local step's inner step, before its sync: where a rank of this island has run out of data
        inside ``join()`` (the island's round of this step had fewer contributors than ranks), the island's
        first rank still training gives every rank of the island its parameters, so that a rank that has joined
        sends its island's progress across, the same as its island's other ranks send in their across groups.
        Every rank of the island reads the same round's flags, so all of them take part or none.

        With ``inside=ShardedState()`` the island's shared parameters arrive here first: a sync may read them."""
        if self.inside is not None:
            self.inside.finish_step(self._inside(ctx))
        island = ctx.engine
        if not island.join.in_block or self._shards is not None:
            return
        contributors = island.outcome.contributors
        if contributors == 0 or contributors >= island.world_size:
            return
        group = ctx.group
        source = torch.tensor([island.world_size if island.join.joined else dist.get_rank(group)], dtype=torch.int64)
        with torch.no_grad(), stalls.inspected(ctx.progress, "the island's parameters to its ranks out of data (join)"):
            dist.all_reduce(source, op=dist.ReduceOp.MIN, group=group)
            collectives.broadcast_parameters(ctx.params, src=int(source.item()), group=group)

    def shadow_step(self, ctx: ModeContext) -> None:
        self._refuse_join(ctx, "a rank ran out of data")

    def settle_after_join(self, ctx: ModeContext, last: int, identical: bool) -> None:
        """Every rank of every island takes the parameters, optimizer state and step count of a rank that
        trained the longest (the most steps): every rank that trained to the end holds the same."""
        whole = self.whole_context(ctx)
        if whole is ctx or whole.world_size == 1:
            super().settle_after_join(ctx, last, identical)
            return
        # A rank that followed its island without data (local SGD across) holds the island's parameters and
        # step count, but not its inner optimizer's state: the source is a rank that trained in its island's
        # last round with contributors.
        mine = torch.tensor([ctx.steps, int(ctx.engine.outcome.contributed_last)], dtype=torch.int64)
        with stalls.inspected(whole.progress, "the exchange of step counts at the end of the join block"):
            gathered = [t.tolist() for t in collectives.all_gather(mine, group=whole.group)]
        steps = [s for s, _ in gathered]
        longest = max(steps)
        source = max(range(len(gathered)), key=lambda r: (steps[r], gathered[r][1], -r))
        if min(steps) != longest or not self._sums_gradients:
            with torch.no_grad(), stalls.inspected(whole.progress, "the parameter broadcast at the end of the join block"):
                collectives.broadcast_parameters(ctx.params, src=source, group=whole.group)
            with stalls.inspected(whole.progress, "the optimizer-state broadcast at the end of the join block"):
                collectives.broadcast_optimizer_state(ctx.optimizer, src=source, group=whole.group)
        if self._across_join is not None:  # local SGD across: its state too, and the across engine leaves the block
            whole.set_steps(longest)
            self.across.broadcast_state(whole, source)
            engine, previous, self._across_join = self._engine, self._across_join, None
            engine.stop_shadowing()
            engine.after_join()
            engine.leave_join(previous)
        # The wrapper sets the island's count next; every later use takes this one first.
        self._steps_after_join = longest

    def ranks_training(self, ctx: ModeContext) -> Optional[int]:
        """As the island's round says; inside ``join()``, fewer than the island's ranks as soon as a rank of
        any island has joined (the sum across counts every island's contributors), since a collective over
        every island (the drift check, a re-broadcast) cannot run then."""
        training = super().ranks_training(ctx)
        if ctx.engine.join.in_block and not self._sums_gradients:
            # Local SGD across: a rank of another island may have run out unseen (its island's copy syncs on).
            return None if training is None else min(training, ctx.world_size - 1)
        everyone = self._contributors
        if (not ctx.engine.join.in_block or everyone is None or training is None
                or everyone == self.topology.count * self.topology.size):
            return training
        return min(training, ctx.world_size - 1)

    def probe(self, ctx: ModeContext) -> Optional[int]:
        """None across islands: a probe round over this island's engine reaches only its ranks, and a rank of
        another island that has joined waits in its own island's shadow round."""
        if self.whole_context(ctx) is not ctx:
            return None
        return super().probe(ctx)

    def _steps_from_join(self, ctx: ModeContext) -> None:
        """After a join block: the step count of the rank that trained the longest, on every island."""
        if self._steps_after_join is not None:
            ctx.set_steps(self._steps_after_join)
            self._steps_after_join = None

    def _reduce_across(self, ctx: ModeContext) -> None:
        """What the across mode's ``reduce_for_step`` means here: the island's round, then its sum across."""
        ctx.reduce_for_step()
        if self._sums_gradients and self._shards is not None:
            self._cross_shards(ctx)
        elif self._sums_gradients and self._crossed_at != ctx.engine.rounds:
            self._cross(ctx)

    def _cross_after_round(self, ctx: ModeContext) -> None:
        """The island's round settled: sum its gradients across the islands now, so that ``.grad`` is the
        global mean when ``backward()`` returns; then what the inside mode does once a round settles."""
        if self._crossed_at != ctx.engine.rounds:
            self._cross(ctx)
        if self._inside_settled is not None:
            self._inside_settled()

    def _cross(self, ctx: ModeContext) -> None:
        """The hierarchical sum: slice ``j`` across the islands on rank ``j`` of each, then gathered inside.

        Raises:
            RuntimeError: parameters became trainable since the layout was made.
        """
        self._crossed_at = ctx.engine.rounds
        self._extra_bytes = 0
        self._steps_from_join(ctx)
        engine = self._engine
        if self._vote is not None:
            self._vote.enter_round()  # the quorum: how many islands take part (the mean's scale)
        elif engine.world_size == 1:
            return
        scale = self._island_weight(ctx)
        if self._contributors == 0:  # inside join(): no rank of any island contributed; nothing to sum
            return
        if self._owned is not None:
            self._cross_owned(ctx, scale)
            return
        slices = self._layout(ctx)
        if not slices.groups:
            return
        k, place = self.topology.size, self.topology.place_of(dist.get_rank())
        absent_groups = [any(ctx.params[i].grad is None for i in g.members) for g in slices.groups]

        def fill(pack: Pack) -> None:
            pack.absent.clear()
            for j, view in enumerate(pack.views):
                g = slices.of_slot[id(pack.params[j])]
                slices.groups[g].read_slice(ctx.params, view, place)
                if scale is not None:
                    view.mul_(scale)
                if absent_groups[g]:
                    pack.absent.append(j)

        with torch.no_grad():
            if engine.progress is not None:
                engine.progress.phase = "after backward (islands: the gradients' sum across the islands)"
            engine.reset_round()  # a round of its own, even where no step came between two (zero_grad, backward)
            engine.launch_exchange(fill)
            engine.finish_exchange()
            count = engine.world_size
            averaged = engine.config.op == dist.ReduceOp.AVG
            results: List[Tuple[SliceGroup, Tensor, bool]] = []
            for pack in engine.packs:
                flags = pack.flags[: len(pack.params)].tolist()
                for j, view in enumerate(pack.views):
                    group = slices.groups[slices.of_slot[id(pack.params[j])]]
                    complete = flags[j] * (count if averaged else 1) > count - 0.5
                    results.append((group, view, complete))
            failed = self._vote is not None and self._vote.round_failed()  # garbage back: the step is discarded
            for group, view, complete in results:
                complete = complete or failed
                whole = group.gather(view, k, ctx.group, ctx.progress)  # every rank of the island, always
                present = None if complete else self._presence(ctx, group)
                group.write_back(ctx.params, whole, present)

    def _cross_owned(self, ctx: ModeContext, scale: Optional[float]) -> None:
        """``inside=ShardedState(gradients=True)``: the gradients this rank owns (its island's means), summed with
        rank ``j`` of every other island (:class:`~distopt.modes.island_sharding.OwnedGradients`).

        Raises:
            RuntimeError: a parameter this rank owns became trainable after the across engine took them on.
        """
        if self._owned.became_trainable(ctx.params):
            raise RuntimeError(
                f"a frozen parameter became trainable after the first sum across the islands, which {_NOT_YET} "
                f"(across=Synchronous(), inside={self.inside!r}); make it trainable before the first backward, or "
                "give it to the optimizer later with add_param_group() (every rank, at the same point)")
        self._owned.cross(self._engine, scale)

    def clip_grad_norm_(self, ctx: ModeContext, max_norm: float, norm_type: float) -> Tensor:
        """With ``inside=ShardedState(gradients=True)`` each rank of an island holds the gradients it owns: their
        norms are summed over the island (whose ranks own every parameter once), as the inside mode does; with
        synchronous training across they are the global means by then, so the norm is the global one."""
        if self.inside is not None and self.inside.gradients:
            return self.inside.clip_grad_norm_(self._inside(ctx), max_norm, norm_type)
        return super().clip_grad_norm_(ctx, max_norm, norm_type)

    def synchronize(self, ctx: ModeContext) -> None:
        """``opt.synchronize()``: with FSDP2 inside and synchronous training across, the sum across now
        (FSDP2 set the gradients at the end of backward), so that clipping sees the global mean."""
        if self._shards is not None and self._sums_gradients:
            self._cross_shards(ctx)

    def _cross_shards(self, ctx: ModeContext) -> None:
        """FSDP2 inside: each rank's local shard of the island's mean gradient, averaged over its across group
        (the same shard on every island), once per step. FSDP2 sets the gradients at the end of backward, so
        this runs in ``step()`` (or ``opt.synchronize()``). A parameter without a gradient on some island is
        averaged with its zeros; one without a gradient anywhere keeps ``grad=None``."""
        self._refuse_join(ctx, "opt.synchronize()")
        if self._shards_crossed_at == ctx.steps or self._engine.world_size == 1:
            return
        self._shards_crossed_at = ctx.steps
        shards, engine = self._shards, self._engine
        index = {id(alias): i for i, alias in enumerate(shards.refresh())}
        grads = [shards.local_grad(i) for i in range(len(shards.params))]

        def fill(pack: Pack) -> None:
            scale = engine.scale
            pack.absent.clear()
            for j, view in enumerate(pack.views):
                grad = grads[index[id(pack.params[j])]]
                if grad is None:
                    view.zero_()
                    pack.absent.append(j)
                    continue
                view.copy_(grad)
                if scale is not None:
                    view.mul_(scale)

        with torch.no_grad():
            if engine.progress is not None:
                engine.progress.phase = "inside step() (islands: the local shards' gradients across the islands)"
            engine.reset_round()
            engine.launch_exchange(fill)
            engine.finish_exchange()
            for pack in engine.packs:
                flags = pack.flags[: len(pack.params)].tolist()
                for j, view in enumerate(pack.views):
                    i = index[id(pack.params[j])]
                    if grads[i] is not None:
                        grads[i].copy_(view)
                    elif flags[j] > 0:  # some island has a gradient: this one takes the mean with its zeros
                        shards.set_grad(i, view.clone())

    def _island_weight(self, ctx: ModeContext) -> Optional[float]:
        """What this island's mean counts for in the sum across: ``1/islands`` (or nothing, for a sum).

        Inside ``join()`` an island's mean is over its ranks that contributed, so the islands' means are
        weighted by their contributors (an exact sum of the counts across comes first): the result is the
        mean over every rank that contributed, as in a flat world. It also tells a rank that has joined
        when no rank of any island contributes any more (:attr:`_contributors`).
        """
        engine, island = self._engine, ctx.engine
        if not island.join.in_block:
            self._contributors = None
            return engine.scale
        mine = island.outcome.contributors
        count = torch.tensor([mine], dtype=torch.int64)
        with stalls.inspected(engine.progress, "the sum of the islands' contributors (join)"):
            collectives.all_reduce(count, op="sum", group=self._ctx.group)
        self._extra_bytes += count.numel() * count.element_size()
        self._contributors = int(count.item())
        if engine.scale is None or island.join.divide_by_world or not self._contributors:
            return engine.scale  # a sum; or every island's mean is over its whole island already
        return mine / self._contributors

    def _presence(self, ctx: ModeContext, group: "SliceGroup") -> List[bool]:
        """Which of ``group``'s parameters have a gradient on some island: an exact sum of their presence."""
        mine = torch.tensor([ctx.params[i].grad is not None for i in group.members], dtype=torch.int32)
        if self._vote is not None:  # on the manager's group, in its commit protocol (a healing island sends 0)
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            self._ctx.group.allreduce([mine], options).wait()
            self._extra_bytes += mine.numel() * mine.element_size()
            return [bool(v) for v in mine.tolist()]
        with stalls.inspected(self._engine.progress, "the sum of the gradients' presence across the islands"):
            collectives.all_reduce(mine, op="sum", group=self._ctx.group)
        self._extra_bytes += mine.numel() * mine.element_size()
        return [bool(v) for v in mine.tolist()]

    def _layout(self, ctx: ModeContext) -> "Slices":
        """The flat layout of the trainable parameters' gradients, made at the first sum across.

        Raises:
            RuntimeError: a parameter became trainable since (not supported yet).
        """
        trainable = [i for i, p in enumerate(ctx.params) if p.requires_grad]
        if self._slices is None:
            self._lay_out(ctx, trainable)
        elif not set(trainable) <= self._slices.members:
            raise RuntimeError(
                f"a frozen parameter became trainable after the first sum across the islands, which {_NOT_YET}"
                "(across=Synchronous()); make it trainable before the first backward, or give it to the optimizer "
                "later with add_param_group() (every rank, at the same point)")
        return self._slices

    def _lay_out(self, ctx: ModeContext, members: List[int]) -> None:
        """Lay ``members`` (parameter indices) out in slices of their own, which the across engine takes on."""
        if self._slices is None:
            self._slices = Slices(groups=[], of_slot={}, members=set())
        added = self._slices.add(ctx.params, members, self.topology.size)
        if added:
            self._engine.track([g.slot for g in added], [f"island slice of {len(g.members)} {g.key[1]} gradients"
                                                         for g in added])

    # ------------------------------------------------------------------ checkpoints, stats, the drift check

    def state_dict(self, ctx: ModeContext) -> Dict[str, Any]:
        """The inner optimizer's state (with ``inside=ShardedState()`` gathered over the island: every rank of
        the island must call it), the across mode's and the cross-island compressor's."""
        gathered = None if self.inside is None else self.inside.state_dict(self._inside(ctx))
        state = self._state_of_across(ctx)
        return state if gathered is None else {**state, **gathered}

    def sharded_state_dict(self, ctx: ModeContext) -> Optional[Dict[str, Any]]:
        """With ``inside=ShardedState()``: this rank's shard of the inner optimizer's state (over its island,
        without communication), with the across mode's and the compressor's state, which are this rank's own."""
        if self.inside is None:
            return None
        shard = self.inside.sharded_state_dict(self._inside(ctx))
        shard.update({k: v for k, v in self._state_of_across(ctx).items() if k not in island_sharding.OPTIMIZER_KEYS})
        return shard

    def _state_of_across(self, ctx: ModeContext) -> Dict[str, Any]:
        """The across mode's state dict (the inner optimizer's, as this rank holds it, and its own) and the
        cross-island compressor's."""
        self._steps_from_join(ctx)
        self._across_params(ctx)
        self._ctx.set_steps(ctx.steps)
        state = self.across.state_dict(self._ctx)
        if self.compressor is not None:
            state = dict(state)
            state[STATE_KEY] = {"compression": self.compressor.state_dict()}
        return state

    def load_state_dict(self, ctx: ModeContext, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (or a plain optimizer's); with ``inside=ShardedState()`` also
        this rank's own :meth:`sharded_state_dict`, and either keeps this rank's shard of the state."""
        mine = state_dict.get(STATE_KEY)
        rest = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        self._across_params(ctx)
        self._ctx.set_steps(ctx.steps)
        if self.inside is None:
            self.across.load_state_dict(self._ctx, rest)
        else:
            rest = island_sharding.load(self.inside, self._inside(ctx), rest)  # the inner optimizer's shard
            if not self._sums_gradients:  # the across mode's own state (it loads the inner optimizer's again)
                self.across.load_state_dict(self._ctx, rest)
                island_sharding.drop_foreign_state(self.inside, ctx.optimizer)
        ctx.set_steps(self._ctx.steps)  # local SGD's checkpoint holds the step count
        if self.compressor is not None and mine is not None:
            self.compressor.load_state_dict(mine["compression"])

    def broadcast_optimizer_state(self, ctx: ModeContext, src: int) -> None:
        """Give every rank of every island island 0's rank ``src``'s optimizer state, and the across mode's
        (local SGD's step count, last-sync copies and outer optimizer)."""
        whole = self.whole_context(ctx)
        if whole.world_size == 1:
            return
        if self.inside is not None:
            raise RuntimeError(
                f"broadcast_optimizer_state() with inside={self.inside!r}: each rank of an island holds its own shard "
                "of the optimizer state, so the root's state is not everyone's; load the full state dict (or each "
                "rank's own sharded_state_dict()) on every rank with opt.load_state_dict() instead")
        if self._shards is not None:
            raise RuntimeError(
                f"broadcast_optimizer_state() with FSDP2 inside the islands {_NOT_YET}: the optimizer state is "
                "sharded (DTensors); load the checkpoint on every rank instead, e.g. with torch.distributed.checkpoint "
                "(dcp.load, then set_optimizer_state_dict(model, opt, ...)), which gives each rank its own shard")
        root = self._whole_rank(src) if whole is not ctx else src
        with stalls.inspected(whole.progress, "the optimizer-state broadcast"):
            collectives.broadcast_optimizer_state(ctx.optimizer, src=root, group=whole.group)
        if not self._sums_gradients:
            self.across.broadcast_state(whole, root)  # the across engine's phase follows the step count
            ctx.set_steps(whole.steps)

    def broadcast_state(self, ctx: ModeContext, src: int) -> None:
        """The end of a join block: :meth:`settle_after_join` gave every rank its state already."""
        self._steps_from_join(ctx)

    def whole_context(self, ctx: ModeContext) -> ModeContext:
        """Every rank of every island, rooted at island 0's root: the drift check compares the islands with
        each other, not only inside, and ``broadcast_parameters()`` reaches every island."""
        self._steps_from_join(ctx)
        if self._world is not None:
            whole = self._world
        elif self.topology is not None and self.topology.count > 1:  # islands of one rank: across is everyone
            whole = self._ctx
        else:
            return ctx
        whole.set_steps(ctx.steps)
        return whole

    def kept_identical(self, ctx: ModeContext, scheduled: bool) -> Optional[drift.Kept]:
        """What every rank of every island holds alike: everything with synchronous training across (as
        synchronous training keeps it); with local SGD or DiLoCo across, what they keep alike (the
        parameters right after a sync, the last-sync copies and the outer optimizer between two)."""
        self._steps_from_join(ctx)
        if self._sums_gradients and self._shards is not None:
            return self._shards.kept_identical(ctx.optimizer, ctx.steps)
        if self.inside is not None and self._sums_gradients:
            return self.inside.kept_identical(self._inside(ctx), scheduled)  # not the state: each rank's shard
        if self._sums_gradients:
            return super().kept_identical(ctx, scheduled)
        if self.inside is not None:
            self.inside.finish_step(self._inside(ctx))
        self._across_params(ctx)
        self._ctx.set_steps(ctx.steps)
        return self.across.kept_identical(self._ctx, scheduled)

    def agree_on_drift(self, ctx: ModeContext, report: drift.DriftReport) -> drift.DriftReport:
        """FSDP2 inside: each across group compared its own shard, so the ranks of an island take the report
        of the first of them that found a drift; then every rank of every island acts alike."""
        if self._shards is None or self.topology is None or self.topology.size == 1:
            return report
        with stalls.inspected(None, "the exchange of the drift check's reports inside the island"):
            reports = collectives.all_gather_object(report, group=self._island_group)
        return next((r for r in reports if r.drifted), report)

    def extra_state_bytes(self, ctx: ModeContext) -> int:
        held = 0 if self._slices is None else self._slices.nbytes()
        return held + (0 if self._ctx is None else self.across.extra_state_bytes(self._ctx))


def _param(described: List[Tuple[Optional[str], Tuple[int, ...], str, bool]], i: int) -> str:
    """Parameter ``i`` as :meth:`Islands._agree_across` describes it, for an error message."""
    if i >= len(described):
        return "missing"
    name, shape, dtype, trainable = described[i]
    named = "" if name is None else f"{name!r} "
    return f"{named}of shape {list(shape)} {dtype}{'' if trainable else ' (frozen)'}"


def _is_mesh(value: Any) -> bool:
    """Whether ``value`` is a ``DeviceMesh`` (imported only when one could be: torch's module is heavy)."""
    if not (hasattr(value, "mesh") and hasattr(value, "mesh_dim_names")):
        return False
    from torch.distributed.device_mesh import DeviceMesh
    return isinstance(value, DeviceMesh)


def _subgroups(topology: Topology, island: Tuple[int, ...], across: Tuple[int, ...], ranks: List[int],
               parent: ProcessGroup) -> Tuple[ProcessGroup, ProcessGroup]:
    """This rank's island group and across group (``parent`` itself where one holds all of its ranks).

    Over the default group every rank builds every island's group, then every across group, in that order,
    so that torch numbers them (a name built from the ranks and the number of groups a process holds, what
    a group built by its members alone gets, can come round again once a group is destroyed). Over a
    subgroup only its ranks may take part, so each builds its own two, island first
    (:func:`~distopt.transport.private_groups.build_by_members`).
    """
    options = {"backend": dist.get_backend(parent), "timeout": private_groups.timeout_of(parent)}
    whole = len(ranks) == dist.get_world_size()
    built: Dict[Tuple[int, ...], ProcessGroup] = {}
    for members in ([*topology.islands] if whole else [island]) + (topology.across() if whole else [across]):
        if len(members) == len(ranks):
            built[members] = parent
        elif whole:
            built[members] = dist.new_group(ranks=sorted(members), **options)
        else:
            built[members] = private_groups.build_by_members(sorted(members), options["backend"], options["timeout"])
    return built[island], built[across]


def _alone(me: int, ranks: List[int], parent: ProcessGroup) -> ProcessGroup:
    """A group of this rank alone (FSDP2 inside: the wrapper's engine averages nothing), built as
    :func:`_subgroups` builds its groups: over the default group every rank builds every rank's."""
    if len(ranks) == 1:
        return parent
    options = {"backend": dist.get_backend(parent), "timeout": private_groups.timeout_of(parent)}
    if len(ranks) == dist.get_world_size():
        built = {rank: dist.new_group(ranks=[rank], **options) for rank in sorted(ranks)}
        return built[me]
    return private_groups.build_by_members([me], options["backend"], options["timeout"])


def _stepping_inside(mode: "Islands", ctx: ModeContext) -> Callable[[Optional[Callable[[], Any]]], Any]:
    """The across context's inner step with ``inside=ShardedState()`` (local SGD across): this rank's shard of
    the island's mean gradient, then the share inside the island (through a weak reference to ``mode``)."""
    ref = weakref.ref(mode)

    def step(closure: Optional[Callable[[], Any]]) -> Any:
        held = ref()
        if held is None or held.inside is None:
            raise RuntimeError("the distopt.Islands mode of this optimizer was dropped")
        return held.inside.step(held._inside(ctx), closure)

    return step


def _nothing() -> None:
    """What the drift check's context does for ``reduce_for_step`` and ``synchronize``: it reduces nothing."""


def _weakly(mode: "Islands", call: Callable[["Islands"], None]) -> Callable[[], None]:
    """``call(mode)`` through a weak reference, so that the engines' callbacks keep no dropped mode alive."""
    ref = weakref.ref(mode)

    def run() -> None:
        held = ref()
        if held is not None:
            call(held)

    return run
