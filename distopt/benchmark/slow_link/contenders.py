"""Who competes on the slow link, by name: no communication, DDP with its comm hooks, and distopt.

A contender turns a fresh replica and its inner optimizer into what a training step
calls (:class:`Built`). Every contender runs in a pair of processes of its own (one
per rank, :mod:`.worker`), so one that aborts cannot take another down.

* ``local``: the inner optimizer alone, no communication. The floor.
* ``ddp``: ``DistributedDataParallel`` with its defaults.
* ``ddp-fp16``: DDP with ``default_hooks.fp16_compress_hook``.
* ``ddp-powersgd``: DDP with ``powerSGD_hook`` (rank ``--powersgd-rank``, error
  feedback and warm start on, ``start_powerSGD_iter=2``, the least it accepts).
* ``ddp-postlocal4``: DDP with ``post_localSGD_hook`` and ``PostLocalSGDOptimizer``
  with ``PeriodicModelAverager(period=4)``: the same schedule as distopt's
  ``sync_every=4`` (parameters averaged after steps 4, 8, ...; see :func:`_ddp_post_local`).
* distopt: one contender per row of :data:`DISTOPT_SPECS`, the table to edit:
  each compressor alone and with local SGD (``sync_every=4``), and DiLoCo.
* Sharded optimizer state: ``distopt-shard`` (``shard_state=True``: the parameter share
  waited for in the step), ``distopt-shard-background`` (``ShardedState(share="background")``:
  the share overlaps the next forward), ``distopt-shard-gradients`` (``shard_state="gradients"``:
  the gradients reduce-scattered to their owners, ZeRO-2), ``distopt-shard-gradients-background``
  (the same with the share in the background), ``distopt-shard-gradients-fp16`` and
  ``distopt-shard-gradients-fp16-background`` (the same two with the gradient chunks in 16 bits,
  ``compression="fp16"``), ``zero`` (torch's
  ``ZeroRedundancyOptimizer`` under DDP) and ``zero-overlap`` (with ``overlap_with_ddp=True``
  and ``hook_with_zero_step``; torch refuses it on gloo, so it is reported unavailable there).
* Two levels, for ``--ranks-per-host 2`` and more (:data:`ISLAND_CONTENDERS`; the islands
  are the ranks of one namespace): ``island-alone``, synchronous distopt over each island
  alone, no cross-host traffic (the floor of the two-level contenders); ``hsdp``, torch's
  ``fully_shard`` over a 2-D mesh (shard inside a host, replicate across); and
  ``distopt.Islands`` with synchronous training across (``islands``, ``islands-int8``),
  DiLoCo and streaming DiLoCo across (``islands-diloco16``, ``islands-stream16``); and the same with
  FSDP2 inside each island (``fully_shard`` over the island's ranks, distopt across: ``islands-fsdp``,
  HSDP's shape with distopt's synchronous sum across, ``islands-fsdp-diloco16``,
  ``islands-fsdp-stream16``).

A contender whose construction raises (an argument this distopt does not have yet, a
compressor that refuses the model) is reported as unavailable, with the reason.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from ...modes import DiLoCo, Islands, ShardedState, Synchronous
from ...wrapper.optimizer import DistributedOptimizer

__all__ = ["PERIOD", "STREAM_PERIOD", "ContenderOptions", "Built", "Contender", "Factory", "DistoptSpec", "DISTOPT_SPECS",
           "CONTENDERS", "ISLAND_CONTENDERS", "host_islands", "rebuilt"]

#: H of every periodic contender: distopt's local SGD and DiLoCo, and DDP's PostLocalSGD.
PERIOD = 4
#: H of DiLoCo and streaming DiLoCo, the period they are meant for (the issue's H >= 16).
STREAM_PERIOD = 16


@dataclass(frozen=True)
class ContenderOptions:
    """Settings the command line passes to every contender.

    Attributes:
        powersgd_rank: the rank of both PowerSGDs (DDP's hook and distopt's compressor).
        powersgd_start: steps both PowerSGDs send uncompressed first: DDP's hook needs
            at least 2 (``start_powerSGD_iter``) with error feedback or warm start, and
            distopt's starts at the same step so that they are compared alike.
        ranks_per_host: ranks in each namespace (``--ranks-per-host``): the size of an island.
    """

    powersgd_rank: int = 4
    powersgd_start: int = 2
    ranks_per_host: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.powersgd_rank, bool) or not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            raise ValueError(f"--powersgd-rank={self.powersgd_rank!r} must be an integer of at least 1, e.g. 4")
        if self.powersgd_start < 2:
            raise ValueError(f"powersgd_start={self.powersgd_start!r} must be at least 2: DDP's PowerSGD hook "
                             "refuses start_powerSGD_iter < 2 with error feedback or warm start")
        if isinstance(self.ranks_per_host, bool) or not isinstance(self.ranks_per_host, int) or self.ranks_per_host < 1:
            raise ValueError(f"--ranks-per-host={self.ranks_per_host!r} must be an integer of at least 1, e.g. 2")


@dataclass
class Built:
    """What a training step uses.

    Attributes:
        module: what the forward pass calls (the replica, or DDP around it).
        optimizer: what ``step()`` and ``zero_grad()`` are called on.
        distopt: the distopt optimizer, whose ``stats`` the report reads; None for the others.
        library_bytes: what distopt says the last step sent, where that is not ``distopt.stats.bytes``
            (``Islands``: its cross-host level's, ``mode.across_stats.bytes``); None: ``stats.bytes``.
    """

    module: nn.Module
    optimizer: Any
    distopt: Optional[DistributedOptimizer] = None
    library_bytes: Optional[Callable[[], int]] = None


#: ``build(replica, inner optimizer, options)``: the replica and its optimizer, wrapped.
Build = Callable[[nn.Module, torch.optim.Optimizer, ContenderOptions], Built]


@dataclass(frozen=True)
class Contender:
    """One contender.

    Attributes:
        name: the ``--contenders`` name.
        description: for the report.
        build: wraps the replica and its inner optimizer.
        baseline: the uncompressed contender whose final loss this one's is compared with (None: not a
            compressed variant).
    """

    name: str
    description: str
    build: Build
    baseline: Optional[str] = None


def _local(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    return Built(model, inner)


def _ddp(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    return Built(nn.parallel.DistributedDataParallel(model), inner)


def _ddp_fp16(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return Built(ddp, inner)


def _ddp_powersgd(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    ddp = nn.parallel.DistributedDataParallel(model)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=options.powersgd_rank,
                                        start_powerSGD_iter=options.powersgd_start, use_error_feedback=True,
                                        warm_start=True, random_seed=0)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return Built(ddp, inner)


def _distopt_shard(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    opt = DistributedOptimizer(inner, pack_threshold="auto", shard_state=True)
    return Built(model, opt, opt)


def _distopt_shard_background(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    opt = DistributedOptimizer(inner, pack_threshold="auto", mode=ShardedState(share="background"))
    return Built(model, opt, opt)


def _distopt_shard_gradients(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    opt = DistributedOptimizer(inner, pack_threshold="auto", shard_state="gradients")
    return Built(model, opt, opt)


def _distopt_shard_gradients_background(model: nn.Module, inner: torch.optim.Optimizer,
                                        options: ContenderOptions) -> Built:
    opt = DistributedOptimizer(inner, pack_threshold="auto", mode=ShardedState(share="background", gradients=True))
    return Built(model, opt, opt)


def _distopt_shard_gradients_fp16(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    # The gradient chunks travel to their owners in 16 bits; the parameter share after the step stays exact.
    opt = DistributedOptimizer(inner, pack_threshold="auto", shard_state="gradients", compression="fp16")
    return Built(model, opt, opt)


def _distopt_shard_gradients_fp16_background(model: nn.Module, inner: torch.optim.Optimizer,
                                             options: ContenderOptions) -> Built:
    opt = DistributedOptimizer(inner, pack_threshold="auto", mode=ShardedState(share="background", gradients=True),
                               compression="fp16")
    return Built(model, opt, opt)


def _zero(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions, overlap: bool = False) -> Built:
    """torch's ``ZeroRedundancyOptimizer`` (the inner optimizer's class and settings) under DDP."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = nn.parallel.DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(inner), overlap_with_ddp=overlap,
                                   **inner.defaults)
    if overlap:
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    return Built(ddp, zero)


def _zero_overlap(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    return _zero(model, inner, options, overlap=True)


def _ddp_post_local(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    """DDP's PostLocalSGD, on distopt's ``sync_every=PERIOD`` schedule.

    ``start_localSGD_iter=0``: local from the first step, as distopt's local SGD without
    ``local_warmup``. ``post_local_gradient_allreduce=False``: after the start DDP
    all-reduces gradients within each node's subgroup, which with one rank per host is
    the rank alone, so it skips that. ``warmup_steps=PERIOD - 1``: torch's averager
    averages at its warm-up step itself, so this averages after steps 4, 8, ... like
    distopt (docs/modes.md says more).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    ddp = nn.parallel.DistributedDataParallel(model)
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                              post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=PERIOD, warmup_steps=PERIOD - 1)
    return Built(ddp, PostLocalSGDOptimizer(optim=inner, averager=averager))


@dataclass(frozen=True)
class Factory:
    """A compressor built from the command line's settings, and how the report writes it.

    Attributes:
        label: what the report shows, e.g. ``"PowerSGD(rank=R)"``.
        build: makes the compressor from the :class:`ContenderOptions`.
    """

    label: str
    build: Callable[[ContenderOptions], Any]


def _build_powersgd(options: ContenderOptions) -> Any:
    from ... import compression

    return compression.PowerSGD(rank=options.powersgd_rank, start_step=options.powersgd_start)


def _build_topk32(options: ContenderOptions) -> Any:
    from ... import compression

    return compression.TopK(group_size=32)


_POWERSGD = Factory("PowerSGD(rank=R)", _build_powersgd)
_TOPK32 = Factory("TopK(group_size=32)", _build_topk32)


def _nesterov(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # DiLoCo's outer optimizer (Douillard et al. 2023), fused: one pass over the anchors instead of four
    # (a streaming fragment of the mlp: 0.6 ms instead of 1.0 on one core), the same update.
    params = list(params)
    try:
        return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True, fused=True)
    except RuntimeError:  # an older torch, which fuses SGD on GPUs only
        return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


#: A distopt contender's compression: None, a name ``compression=`` takes, or a factory of the object.
Compression = Union[None, str, Factory]


@dataclass(frozen=True)
class DistoptSpec:
    """One distopt contender: a row of :data:`DISTOPT_SPECS`.

    Attributes:
        name: the ``--contenders`` name.
        compression: ``compression=``: None, a name (``"fp16"``, ``"int8"``, ...), or a
            :class:`Factory` built with the :class:`ContenderOptions` (PowerSGD at ``--powersgd-rank``).
        sync_every: ``sync_every=``: 1 is synchronous; :data:`PERIOD` is local SGD.
        diloco: an outer Nesterov SGD (lr 0.7, momentum 0.9) steps on the averaged change (DiLoCo).
        pack_threshold: ``pack_threshold=``; ``"auto"`` sizes packs from the measured link.
        baseline: the uncompressed contender its final loss is compared with.
        more: further keyword arguments, as ``(name, value)`` pairs (streaming's
            ``sync_fragments``, ``sync_overlap``, ``sync_mixing``).
    """

    name: str
    compression: Compression = None
    sync_every: int = 1
    diloco: bool = False
    pack_threshold: Union[int, str] = "auto"
    baseline: Optional[str] = None
    more: Tuple[Tuple[str, Any], ...] = ()

    def kwargs(self, options: ContenderOptions) -> Dict[str, Any]:
        """The ``DistributedOptimizer`` keyword arguments of this row."""
        kwargs: Dict[str, Any] = {"pack_threshold": self.pack_threshold}
        if self.compression is not None:
            kwargs["compression"] = (self.compression if isinstance(self.compression, str)
                                     else self.compression.build(options))
        if self.sync_every != 1 or self.diloco:
            kwargs["sync_every"] = self.sync_every
        if self.diloco:
            kwargs["outer_optimizer"] = _nesterov
        kwargs.update(self.more)
        return kwargs

    def describe(self) -> str:
        """For the report: the arguments, as a user would write them."""
        parts = [f"pack_threshold={self.pack_threshold!r}"]
        if self.compression is not None:
            label = repr(self.compression) if isinstance(self.compression, str) else self.compression.label
            parts.append(f"compression={label}")
        if self.sync_every != 1 or self.diloco:
            parts.append(f"sync_every={self.sync_every}")
        if self.diloco:
            parts.append("outer_optimizer=Nesterov SGD lr 0.7")
        parts += [f"{k}={v!r}" for k, v in self.more]
        return "DistributedOptimizer(" + ", ".join(parts) + ")"

    def contender(self) -> Contender:
        """This row as a :class:`Contender`."""
        def build(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
            opt = DistributedOptimizer(inner, **self.kwargs(options))
            return Built(model, opt, opt)

        return Contender(self.name, self.describe(), build, self.baseline)


_COMPRESSORS: Tuple[Tuple[str, Compression], ...] = (
    ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4"), ("powersgd", _POWERSGD),
)

#: The distopt contenders, in run order: plain, each compressor alone, local SGD plain and with each
#: compressor (its pseudo-gradients compressed), and DiLoCo. Edit this table to change them.
DISTOPT_SPECS: Tuple[DistoptSpec, ...] = (
    DistoptSpec("distopt"),
    *(DistoptSpec(f"distopt-{name}", compression, baseline="distopt") for name, compression in _COMPRESSORS),
    DistoptSpec(f"distopt-local{PERIOD}", sync_every=PERIOD),
    *(DistoptSpec(f"distopt-local{PERIOD}-{name}", compression, sync_every=PERIOD, baseline=f"distopt-local{PERIOD}")
      for name, compression in _COMPRESSORS),
    DistoptSpec(f"diloco{PERIOD}", sync_every=PERIOD, diloco=True),
    DistoptSpec("distopt-powersgd-10M", _POWERSGD, pack_threshold=10 << 20, baseline="distopt"),

    DistoptSpec(f"diloco{STREAM_PERIOD}", sync_every=STREAM_PERIOD, diloco=True),
    # Streaming DiLoCo (docs/modes.md): 4 fragments, each sync hidden behind 2 inner steps, in 4 bits.
    DistoptSpec(f"stream{STREAM_PERIOD}-int4", "int4", sync_every=STREAM_PERIOD, diloco=True,
                baseline=f"diloco{STREAM_PERIOD}",
                more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.5))),
    DistoptSpec(f"stream{STREAM_PERIOD}", sync_every=STREAM_PERIOD, diloco=True, baseline=f"diloco{STREAM_PERIOD}",
                more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.5))),
    # Two, four and eight times the period: a half, a quarter and an eighth of the bytes and arithmetic per
    # step, for models whose step is short for their size (the mlp). Streaming DiLoCo's paper trains with H = 100.
    *(spec for h in (2 * STREAM_PERIOD, 4 * STREAM_PERIOD, 8 * STREAM_PERIOD) for spec in (
        DistoptSpec(f"diloco{h}", sync_every=h, diloco=True),
        DistoptSpec(f"stream{h}-int4", "int4", sync_every=h, diloco=True, baseline=f"diloco{h}",
                    more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.5))))),
    # Streaming DiLoCo with one value in 64 of each outer gradient (TopK): a tenth of int4's bytes.
    *(DistoptSpec(f"stream{h}-topk", "topk", sync_every=h, diloco=True, baseline=f"diloco{h}",
                  more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.5)))
      for h in (STREAM_PERIOD, 2 * STREAM_PERIOD)),
    # From H = 32, top-k with more of the local values kept at each merge: plain DiLoCo's quality there
    # (docs/dev/benchmark-link-log.md, "Top-k and the mix").
    *(DistoptSpec(f"stream{h}-topk-mix75", "topk", sync_every=h, diloco=True, baseline=f"diloco{h}",
                  more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.75)))
      for h in (2 * STREAM_PERIOD, 4 * STREAM_PERIOD)),
    DistoptSpec(f"stream{4 * STREAM_PERIOD}-topk", "topk", sync_every=4 * STREAM_PERIOD, diloco=True,
                baseline=f"diloco{4 * STREAM_PERIOD}",
                more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.5))),
    # Twice the period and one value in 32: the bytes per step of stream16-topk, for its quality at H = 32.
    DistoptSpec(f"stream{2 * STREAM_PERIOD}-topk32", _TOPK32, sync_every=2 * STREAM_PERIOD, diloco=True,
                baseline=f"diloco{2 * STREAM_PERIOD}",
                more=(("sync_fragments", 4), ("sync_overlap", 2), ("sync_mixing", 0.5))),
)


def host_islands(world: int, ranks_per_host: int) -> List[List[int]]:
    """The islands of the benchmark's topology: the ranks of one namespace, numbered one host after the other.

    Args:
        world: every rank.
        ranks_per_host: ranks in each namespace.

    Returns:
        ``[[0, ..., k - 1], [k, ..., 2k - 1], ...]``.

    Raises:
        ValueError: ``ranks_per_host`` is below 2 (an island of one rank is flat training) or does
            not divide ``world``.
    """
    if ranks_per_host < 2 or world % ranks_per_host:
        raise ValueError(f"the two-level contenders need --ranks-per-host 2 or more, dividing the {world} ranks; "
                         f"got {ranks_per_host}: run them with --ranks-per-host 2")
    return [list(range(h, h + ranks_per_host)) for h in range(0, world, ranks_per_host)]


def _islands(options: ContenderOptions) -> List[List[int]]:
    import torch.distributed as dist

    return host_islands(dist.get_world_size(), options.ranks_per_host)


def _island_alone(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    # Synchronous distopt over this rank's island only: what each host trains at without the other.
    import torch.distributed as dist

    mine, _ = dist.new_subgroups_by_enumeration(_islands(options))
    opt = DistributedOptimizer(inner, process_group=mine)
    return Built(model, opt, opt)


def _hsdp(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
    """torch's own HSDP: ``fully_shard`` over a (hosts, ranks per host) mesh, the whole model one unit.

    Inside a host the gradients are reduce-scattered and the parameters all-gathered; across, each
    rank all-reduces its shard. One unit, since a model may read a child's weight outside the child's
    forward (charlm's position table), which a unit of its own would hand it sharded. The inner
    optimizer is rebuilt over the sharded parameters, with its settings.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    islands = _islands(options)
    mesh = init_device_mesh("cpu", (len(islands), options.ranks_per_host), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return Built(model, rebuilt(inner, model.parameters()))


def rebuilt(inner: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of ``inner``'s class and settings over ``params`` (FSDP2's sharded parameters).

    Only the settings its constructor takes: ``defaults`` also holds derived ones, such as
    AdamW's ``decoupled_weight_decay``, which ``AdamW()`` refuses.
    """
    takes = inspect.signature(type(inner).__init__).parameters
    return type(inner)(params, **{k: v for k, v in inner.defaults.items() if k in takes})


def _island_contender(across: Callable[[], Any], compression: Optional[str] = None) -> Build:
    def build(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
        mode = Islands(across(), islands=_islands(options), compression=compression)
        opt = DistributedOptimizer(inner, mode=mode)
        return Built(model, opt, opt, lambda: int(mode.across_stats.bytes))

    return build


def _fsdp_island_contender(across: Callable[[], Any]) -> Build:
    """``Islands`` over FSDP2: ``fully_shard`` over each island's ranks (the model one unit, as :func:`_hsdp`),
    the inner optimizer rebuilt over the sharded parameters, and ``across`` between the islands."""
    def build(model: nn.Module, inner: torch.optim.Optimizer, options: ContenderOptions) -> Built:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        islands = _islands(options)
        mesh = init_device_mesh("cpu", (len(islands), options.ranks_per_host), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        mode = Islands(across(), islands=mesh)
        opt = DistributedOptimizer(rebuilt(inner, model.parameters()), mode=mode)
        return Built(model, opt, opt, lambda: int(mode.across_stats.bytes))

    return build


def _diloco(**streaming: Any) -> Callable[[], Any]:
    return lambda: DiLoCo(every=STREAM_PERIOD, outer=_nesterov, **streaming)


#: The two-level contenders (``--ranks-per-host 2`` and more), in run order.
ISLAND_CONTENDERS: Tuple[Contender, ...] = (
    Contender("island-alone", "synchronous distopt over each host's ranks alone, nothing across", _island_alone),
    Contender("hsdp", "fully_shard over a (hosts, ranks per host) mesh, the model one unit: HSDP", _hsdp),
    Contender("islands", "Islands(across=Synchronous()): hierarchical, each rank sends 1/k across",
              _island_contender(Synchronous)),
    Contender("islands-int8", "Islands(across=Synchronous(), compression='int8')",
              _island_contender(Synchronous, "int8"), baseline="islands"),
    Contender(f"islands-diloco{STREAM_PERIOD}", f"Islands(across=DiLoCo(every={STREAM_PERIOD}, Nesterov lr 0.7))",
              _island_contender(_diloco())),
    Contender(f"islands-stream{STREAM_PERIOD}",
              f"Islands(across=DiLoCo(every={STREAM_PERIOD}, fragments=4, overlap=2, mixing=0.5))",
              _island_contender(_diloco(fragments=4, overlap=2, mixing=0.5)),
              baseline=f"islands-diloco{STREAM_PERIOD}"),
    Contender("islands-fsdp", "FSDP2 inside each host, Islands(across=Synchronous()): HSDP's shape, distopt across",
              _fsdp_island_contender(Synchronous)),
    Contender(f"islands-fsdp-diloco{STREAM_PERIOD}",
              f"FSDP2 inside each host, Islands(across=DiLoCo(every={STREAM_PERIOD}, Nesterov lr 0.7))",
              _fsdp_island_contender(_diloco())),
    Contender(f"islands-fsdp-stream{STREAM_PERIOD}",
              f"FSDP2 inside each host, Islands(across=DiLoCo(every={STREAM_PERIOD}, fragments=4, overlap=2, "
              "mixing=0.5))",
              _fsdp_island_contender(_diloco(fragments=4, overlap=2, mixing=0.5))),
)


#: Every contender, by name, in run order.
CONTENDERS: Dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("local", "the inner optimizer alone, no communication", _local),
        Contender("ddp", "DistributedDataParallel, defaults", _ddp),
        Contender("ddp-fp16", "DDP + fp16_compress_hook", _ddp_fp16, baseline="ddp"),
        Contender("ddp-powersgd", "DDP + powerSGD_hook (rank R, start_powerSGD_iter 2)", _ddp_powersgd,
                  baseline="ddp"),
        Contender(f"ddp-postlocal{PERIOD}", f"DDP + post_localSGD_hook + PostLocalSGDOptimizer, period {PERIOD}",
                  _ddp_post_local),
        *(spec.contender() for spec in DISTOPT_SPECS),
        Contender("distopt-shard", "DistributedOptimizer(pack_threshold='auto', shard_state=True)", _distopt_shard),
        Contender("distopt-shard-background", "the same, mode=ShardedState(share='background')",
                  _distopt_shard_background),
        Contender("distopt-shard-gradients", "DistributedOptimizer(pack_threshold='auto', shard_state='gradients')",
                  _distopt_shard_gradients),
        Contender("distopt-shard-gradients-background",
                  "the same, mode=ShardedState(share='background', gradients=True)",
                  _distopt_shard_gradients_background),
        Contender("distopt-shard-gradients-fp16",
                  "DistributedOptimizer(pack_threshold='auto', shard_state='gradients', compression='fp16')",
                  _distopt_shard_gradients_fp16, baseline="distopt-shard-gradients"),
        Contender("distopt-shard-gradients-fp16-background",
                  "the same, mode=ShardedState(share='background', gradients=True)",
                  _distopt_shard_gradients_fp16_background, baseline="distopt-shard-gradients"),
        Contender("zero", "torch ZeroRedundancyOptimizer under DDP", _zero),
        Contender("zero-overlap", "torch ZeroRedundancyOptimizer(overlap_with_ddp=True) + hook_with_zero_step",
                  _zero_overlap),
        *ISLAND_CONTENDERS,
    )
}
