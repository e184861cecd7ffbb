"""``hvd.DistributedOptimizer``: distopt's :class:`distopt.DistributedOptimizer` under Horovod's signature.

Horovod's arguments are checked with Horovod's wording here and translated to
the core's (``op`` to ``reduce_op``, ``compression`` to the wire type);
``synchronize()``/``skip_synchronize()`` follow Horovod's protocol.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from ..transport import stalls
from ..wrapper.optimizer import DistributedOptimizer as _CoreDistributedOptimizer
from .errors import internal_errors
from .compression import BF16Compressor, Compression, FP16Compressor, NoneCompressor, compressor_class, CompressorLike
from .reduce_op import Adasum, Average, ReduceOp, Sum
from .process_sets import ProcessSet, global_process_set, group_of, solo_group
from .session import generation, require_init, world_group
from .unsupported import ADASUM_ADVICE

# Live optimizers, in creation order: hvd.join() joins those of the open session.
_live: "weakref.WeakValueDictionary[int, DistributedOptimizer]" = weakref.WeakValueDictionary()
_created = iter(range(1 << 62))
# Optimizers built in each session, by the ranks they average over: an optimizer's number among
# those is the same on every rank of its group (ranks outside a process set may not build it).
_built: Dict[Tuple[int, Tuple[int, ...]], int] = {}


def _sparse_noter(dims: Dict[Tensor, int]) -> Callable[[Tensor], None]:
    def note(p: Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            dims[p] = p.grad.sparse_dim()
    return note


def live_optimizers() -> List["DistributedOptimizer"]:
    """The optimizers of the open session that still reduce, in creation order.

    Left out: those built before the last :func:`~distopt.horovod.init` (they belong to a
    session that ended), closed ones, and those a newer optimizer over the same
    parameters replaced.
    """
    return [opt for _, opt in sorted(_live.items())
            if opt._session == generation() and not opt._closed and opt._retired_by is None]


def joining() -> Tuple[List["DistributedOptimizer"], List[Dict[str, Any]]]:
    """What :func:`~.sync.join` joins on this rank: the optimizers to stand in for, and every one described.

    An optimizer dropped but not yet collected (in a reference cycle) is collected first,
    since another rank may have collected its copy already. One whose copy another rank
    closed (or collected) is left out: its rounds can no longer pair. Each description
    (``index`` in the session, ``ranks`` of its group, ``tensors``, ``elements``) is for
    the check that every rank holds the same optimizers.
    """
    gc.collect()
    optimizers, described = [], []
    for opt in live_optimizers():
        if opt.world_size == 1:  # a rank outside its process set trains alone
            continue
        closed_on = opt._closed_elsewhere()
        params = [p for group in opt.param_groups for p in group["params"]]
        described.append({"index": opt._index, "ranks": list(opt._ranks), "tensors": len(params),
                          "elements": sum(p.numel() for p in params)})
        if not closed_on:
            optimizers.append(opt)
    return optimizers, described


# Horovod's names only; live_optimizers and joining serve .sync.
__all__ = [
    "DistributedOptimizer",
]


def _gradient_reduce_op(op: Any, gradient_predivide_factor: float) -> str:
    """The core's ``reduce_op`` for Horovod's ``op`` and ``gradient_predivide_factor``."""
    if op == Adasum:
        raise NotImplementedError(ADASUM_ADVICE)
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum to combine gradients, got {op!r}")
    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    # Dividing by f before the sum and by size/f after is the mean, which the core
    # computes directly (dividing before any 16-bit cast).
    return "mean" if op == Average else "sum"


def _wire_compression(compression: Any) -> Optional[str]:
    if compression is None:
        return None
    cls = compressor_class(compression)
    if cls not in (NoneCompressor, FP16Compressor, BF16Compressor):
        raise TypeError(
            f"compression={cls.__name__} is not supported by hvd.DistributedOptimizer: distopt casts whole "
            "packs on the wire itself; use hvd.Compression.none, hvd.Compression.fp16 or hvd.Compression.bf16"
        )
    return cls.wire


def _check_groups(num_groups: Any, groups: Any) -> None:
    # Horovod's explicit fusion groups; distopt packs gradients by size (pack_threshold) instead.
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative integer, got {num_groups!r}")
    if num_groups:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed; distopt ignores both "
            "and packs gradients by size",
            DeprecationWarning,
            stacklevel=3,
        )
    if groups is None:
        return
    if isinstance(groups, bool) or not (
        (isinstance(groups, int) and groups >= 0)
        or (isinstance(groups, list) and all(isinstance(g, (list, tuple)) for g in groups))
    ):
        raise ValueError(f"groups should be a non-negative integer or a list of list of torch.Tensor, got {groups!r}")


def _check_named_parameters(named_parameters: Any, optimizer: Optimizer) -> List[Tuple[str, Tensor]]:
    """Horovod's checks, with the unnamed parameters located; one name per parameter."""
    pairs = list(named_parameters)
    if any(not isinstance(p, tuple) for p in pairs):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()."
        )
    names = [name for name, _ in pairs]
    duplicates = sorted({str(n) for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    named_ids = {id(p) for _, p in pairs}
    unnamed = [
        f"param_groups[{g}]['params'][{j}] (shape {list(p.shape)})"
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
        if id(p) not in named_ids
    ]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but one or more model parameters were not named: "
            f"{', '.join(unnamed[:5])}{' ...' if len(unnamed) > 5 else ''}; pass the named_parameters() "
            "of the model whose parameters the optimizer holds"
        )
    # Horovod lets one tensor appear under two names (tied weights); the first name is kept.
    seen: Dict[int, str] = {}
    return [(name, p) for name, p in pairs if seen.setdefault(id(p), name) == name]


class DistributedOptimizer(_CoreDistributedOptimizer):
    """Horovod's ``hvd.DistributedOptimizer``: distopt's optimizer under Horovod's signature.

    Gradients are averaged (or summed) over all ranks during ``backward()``, in
    packs that overlap the rest of the backward pass; ``step()`` finishes any
    reduction still due and applies the inner optimizer. Also everything of
    :class:`distopt.DistributedOptimizer` (``no_sync()``, ``stats``, ...).

    Differences from Horovod: the object wraps ``optimizer`` rather than being
    an instance of its class (``opt.optimizer`` is the inner one); it keeps the
    inner optimizer's state; parameters are broadcast from rank 0 at
    construction (``hvd.broadcast_parameters`` is still honored);
    ``zero_grad()`` between ``backward()`` and ``step()`` is allowed. Like
    Horovod's, it is always ready for :func:`hvd.join() <distopt.horovod.join>`:
    ranks that joined count as zeros in the average.

    Args:
        optimizer: the ``torch.optim`` optimizer to wrap.
        named_parameters: ``model.named_parameters()``, to check the names and
            name parameters in errors (default: None).
        compression: ``hvd.Compression.none`` (default), ``hvd.Compression.fp16``
            or ``hvd.Compression.bf16``: 16-bit gradients on the wire.
        backward_passes_per_step: backward passes accumulated locally before the
            gradients are reduced, on the last of them (default: 1).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, Horovod divides by it before the
            sum and by ``size / factor`` after; the result is the same mean, which
            distopt computes directly (default: 1.0).
        num_groups: deprecated in Horovod; accepted and ignored (default: 0).
        groups: Horovod's fusion groups; accepted and ignored, distopt packs
            gradients by size (default: None).
        sparse_as_dense: accepted for Horovod's signature: sparse gradients always travel
            dense here (the same sum) and, as with Horovod, are sparse again for the step
            (default: False).
        process_set: the ranks to average over (default: all); on a rank outside
            it, the optimizer steps on local gradients, as Horovod's does.

    Raises:
        ValueError: on a bad argument (Horovod's wording), e.g. duplicate or
            missing ``named_parameters``.
        TypeError: if ``optimizer`` is not a ``torch.optim`` optimizer, or
            ``compression`` is not one of ``hvd.Compression``'s.
        NotImplementedError: for ``op=hvd.Adasum``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
        compression: Optional[CompressorLike] = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Optional[Any] = None,
        sparse_as_dense: bool = False,
        process_set: Any = global_process_set,
    ) -> None:
        require_init()
        outside = isinstance(process_set, ProcessSet) and world_group() is not None and not process_set.included()
        # Horovod: a rank outside the set trains on its own; here over a group of itself alone.
        group = solo_group() if outside else group_of(process_set)
        reduce_op = _gradient_reduce_op(op, gradient_predivide_factor)
        wire = _wire_compression(compression)
        _check_groups(num_groups, groups)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; e.g. "
                "hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))"
            )
        named = None if named_parameters is None else _check_named_parameters(named_parameters, optimizer)
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self._should_synchronize = True  # False inside skip_synchronize()
        self._synchronized = False  # synchronize() ran since the last step()/zero_grad()
        self._skipping_reduction = False  # inside a step() that must not reduce
        # Horovod hands sparse gradients (nn.Embedding(sparse=True)) back sparse, for SparseAdam and the
        # like, whatever sparse_as_dense says. Here they travel dense (the same sum), and are made sparse
        # again before the step. These hooks run before the core's, which densify; a parameter's hook
        # goes once its gradient was seen dense (a layer's gradients keep their layout).
        self._sparse_dims: Dict[Tensor, int] = {}
        self._sparse_hooks = {p: p.register_post_accumulate_grad_hook(_sparse_noter(self._sparse_dims))
                              for group_ in optimizer.param_groups for p in group_["params"] if p.requires_grad}
        try:
            super().__init__(
                optimizer,
                reduce_op=reduce_op,
                compression=wire,
                backward_passes_per_step=backward_passes_per_step,
                named_parameters=named,
                sparse_as_dense=True,
                process_group=None if process_set is global_process_set or process_set is None else group,
            )
        except BaseException:
            self._remove_sparse_hooks()
            raise
        # Horovod's name for each parameter (the user's, else by position); read by Horovod users' code.
        self._parameter_names: Dict[Tensor, str] = (
            {p: name for name, p in named} if named is not None else
            {p: f"allreduce.noname.{i}.{j}" for i, group_ in enumerate(optimizer.param_groups)
             for j, p in enumerate(group_["params"])})
        # Always ready for hvd.join(), with Horovod's meaning: joined ranks count as zeros in the average.
        self._engine.enter_join(divide_by_world=True)
        self._session = generation()
        self._ranks: Tuple[int, ...] = ()  # the global ranks it averages over; none when it trains alone
        if self.world_size > 1:
            self._ranks = tuple(dist.get_process_group_ranks(self.process_group or dist.group.WORLD))
        key = (self._session, self._ranks)
        self._index = _built.get(key, 0)
        _built[key] = self._index + 1
        self._closed = False
        _live[next(_created)] = self

    def synchronize(self) -> None:
        """Finish averaging gradients now, e.g. before clipping or ``GradScaler.unscale_``.

        Then take the step inside :meth:`skip_synchronize`. Also reduces when fewer
        than ``backward_passes_per_step`` passes ran. Never reduces twice.

        Raises:
            HorovodInternalError: the reduction failed, as Horovod's ``synchronize`` raises it.
        """
        if self._skipping_reduction:
            return
        with internal_errors():
            super().synchronize()
        self._restore_sparse()
        self._synchronized = True

    def _reduce_for_step(self) -> None:
        if not self._skipping_reduction:
            with internal_errors():  # step() waits for the reduction here: Horovod's synchronize
                super()._reduce_for_step()
        self._restore_sparse()

    def _restore_sparse(self) -> None:
        for p, sparse_dim in self._sparse_dims.items():
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse(sparse_dim)
        for p in [p for p in self._sparse_hooks if p.grad is not None and p not in self._sparse_dims]:
            self._sparse_hooks.pop(p).remove()

    def _remove_sparse_hooks(self) -> None:
        for handle in self._sparse_hooks.values():
            handle.remove()
        self._sparse_hooks = {}

    def close(self) -> None:
        """Remove the gradient hooks, destroy the private group and release the parameters."""
        self._closed = True
        self._remove_sparse_hooks()
        super().close()

    def _closed_elsewhere(self) -> List[int]:
        """The ranks of this optimizer's group that closed their copy (close(), or garbage collection)."""
        progress = self._engine.progress
        return [] if progress is None else stalls.closed_members(progress)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Context in which ``step()`` does not reduce gradients: use after :meth:`synchronize`.

        Example::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        previous, self._should_synchronize = self._should_synchronize, False
        try:
            yield
        finally:
            self._should_synchronize = previous

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Reduce gradients not reduced yet (unless in :meth:`skip_synchronize`), then step.

        Warns, as Horovod does, when called after :meth:`synchronize` outside
        :meth:`skip_synchronize` (harmless here, costly under Horovod).

        Args:
            closure: re-evaluates the model and returns the loss (default: None).

        Returns:
            Whatever the inner optimizer's ``step`` returns.
        """
        if self._should_synchronize and self._synchronized:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). distopt does not reduce twice, but Horovod does: wrap the step "
                "in `with optimizer.skip_synchronize():` after calling optimizer.synchronize().",
                stacklevel=2,
            )
        self._skipping_reduction = not self._should_synchronize
        try:
            return super().step(closure)
        finally:
            self._skipping_reduction = False
            self._synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and start a new round; safe at any point (distopt waits for reductions).

        Args:
            set_to_none: set ``.grad`` to None instead of zeroing it (default: True).
        """
        super().zero_grad(set_to_none)
        self._synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before gradients are reduced.

        Call it between ``step()`` and the next ``backward()``; it counts the
        passes of the round since the last ``step()`` or ``zero_grad()``.

        Args:
            passes: backward passes per ``step()``, at least 1.

        Raises:
            ValueError: if ``passes`` is not an int >= 1.
        """
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1 (1 reduces after every backward), got {passes!r}"
            )
        self.backward_passes_per_step = passes
