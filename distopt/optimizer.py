"""``DistributedOptimizer``: data-parallel gradient averaging for any ``torch.optim`` optimizer."""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from . import collectives
from .packing import LaunchOrder, PackSpec, ParamMeta, plan_packs

__all__ = ["DistributedOptimizer", "StepStats", "DEFAULT_PACK_THRESHOLD"]

#: Default pack size in bytes (see the README's benchmark section for how it was chosen).
DEFAULT_PACK_THRESHOLD = 10 * 2**20

_REDUCE_OPS = ("mean", "sum")
_COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_OWNER_ATTR = "_distopt_owner"
# Mean member size (elements) under which a pack is gathered with one cat: below it the
# per-tensor dispatch cost dominates; above it one fused copy-and-scale pass per tensor wins.
_BATCH_GATHER_BELOW = 1 << 12


@dataclass
class StepStats:
    """What the last reduction round did.

    Attributes:
        packs: all-reduces launched.
        packs_at_flush: of those, how many launched only at the end of backward
            (the rest overlapped with backward).
        bytes: bytes put on the wire.
        wait_seconds: time spent blocked waiting for communication.
    """

    packs: int = 0
    packs_at_flush: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0


@dataclass
class _Pack:
    """Runtime state of one planned pack: a persistent flat buffer the gradients live in."""

    spec: PackSpec
    buffer: Tensor  # gradient data, then one presence flag per member
    data: Tensor  # the gradient part of ``buffer``
    views: List[Tensor]  # per member, shaped like its parameter; these become ``.grad``
    flags: Tensor
    params: List[Tensor]  # the members' parameters
    batched: bool  # small members: gather with one cat instead of one copy each
    wire: Optional[Tensor]  # 16-bit copy sent instead of ``buffer`` when compressing
    absent: List[int]  # members that had no local gradient this round


# Round states: gradients accumulate locally (IDLE), the reducing backward is
# running (ACTIVE), gradients are averaged and final (DONE).
_IDLE, _ACTIVE, _DONE = range(3)


class DistributedOptimizer(Optimizer):
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
    ) -> None:
        _check_arguments(optimizer, reduce_op, pack_threshold, bcast_period, backward_passes_per_step, compression)
        self.optimizer = optimizer
        self.reduce_op = reduce_op
        self.pack_threshold = int(pack_threshold)
        self.bcast_period = int(bcast_period)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.compression = None if compression in (None, "none") else compression
        self.sparse_as_dense = bool(sparse_as_dense)
        # None stays None (the default group, looked up per call): holding the default group would
        # keep it alive past destroy_process_group() into interpreter exit.
        self.process_group = process_group
        self.rank = collectives.get_rank(self.process_group)
        self.world_size = collectives.get_world_size(self.process_group)
        if not isinstance(root_rank, int) or not 0 <= root_rank < self.world_size:
            raise ValueError(
                f"root_rank must be a rank of the process group (0..{self.world_size - 1}), got {root_rank!r}"
            )
        self.root_rank = root_rank
        # NCCL averages natively. Otherwise the mean's 1/world is applied while each gradient is
        # copied into its pack (no extra pass), and always before a 16-bit cast, which could overflow.
        native_avg = self.world_size > 1 and dist.get_backend(self.process_group) == "nccl"
        mean = reduce_op == "mean"
        self._scale: Optional[float] = 1.0 / self.world_size if mean and (self.compression or not native_avg) else None
        self._op = dist.ReduceOp.AVG if mean and self._scale is None else dist.ReduceOp.SUM
        self.stats = StepStats()
        self._steps = 0
        self._names_by_id = _names_by_id(named_parameters, optimizer)
        self._params: List[Tensor] = []
        self._names: List[str] = []
        self._handles: List[Any] = []
        self._packs: List[_Pack] = []
        self._pack_of: List[int] = []  # parameter index -> pack index
        self._launch_order = LaunchOrder([])
        self._planned = False
        self._lock = threading.Lock()
        self._sync_enabled = True
        self._track_new_params()

    # ------------------------------------------------------------------ torch.optim.Optimizer surface

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

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

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict: loads into a plain optimizer and back."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load an inner-optimizer state dict (from this wrapper or a plain optimizer)."""
        self.optimizer.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Register on the inner optimizer: it runs with averaged gradients."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        """Registered on the inner optimizer, whose machinery runs it."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer and start averaging its gradients.

        Every rank must add the same group. Its parameters are checked across ranks
        and broadcast from the root like those given at construction.
        """
        if self._state != _IDLE:
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
        if closure is None:
            self.synchronize()
            loss = self.optimizer.step()
        else:
            loss = self.optimizer.step(self._synchronizing(closure))
        self._reset_round()
        self._steps += 1
        if self.bcast_period > 0 and self._steps % self.bcast_period == 0:
            self.broadcast_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (see :meth:`torch.optim.Optimizer.zero_grad`) and start a new round.

        Args:
            set_to_none: set ``.grad`` to None instead of zeroing it (default: True).
        """
        self._wait()  # a reduction may still write into the buffers
        self.optimizer.zero_grad(set_to_none)
        self._reset_round()

    def synchronize(self) -> None:
        """Finish averaging gradients now, e.g. before clipping or ``GradScaler.unscale_``.

        Gradients are normally final when ``backward()`` returns; this also
        reduces them when fewer than ``backward_passes_per_step`` passes ran, or
        when gradients were set by hand. Calling it again, or calling ``step()``
        after it, does not reduce a second time.
        """
        if self.world_size == 1 or self._state == _DONE:
            return
        with self._lock:
            self.stats = StepStats()
            self._flush()
            self._finish_round()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward passes accumulate gradients locally, without communication.

        The first reducing backward after it averages everything accumulated.
        """
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def broadcast_parameters(self) -> None:
        """Overwrite every rank's parameters with the root's (coalesced per device and dtype)."""
        if self.world_size > 1 and self._params:
            with torch.no_grad():
                collectives.broadcast_parameters(self._params, src=self.root_rank, group=self.process_group)

    def broadcast_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state, e.g. when only the root loaded a checkpoint.

        Unlike Horovod, no optimizer step is taken to create the state first, so
        parameters and moments are exactly the root's.
        """
        collectives.broadcast_optimizer_state(self.optimizer, src=self.root_rank, group=self.process_group)

    def close(self) -> None:
        """Remove the gradient hooks and release the parameters for another wrapper."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._params:
            if getattr(p, _OWNER_ATTR, None) is not None and getattr(p, _OWNER_ATTR)() is self:
                delattr(p, _OWNER_ATTR)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ set-up

    def _track_new_params(self) -> None:
        """Take on parameters not tracked yet: check them across ranks, broadcast, hook."""
        known = {id(p) for p in self._params}
        new: List[Tensor] = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) in known or not p.requires_grad:
                    continue
                known.add(id(p))
                new.append(p)
        names = [self._names_by_id.get(id(p), f"param_groups[{g}][{j}]") for g, j, p in _positions(self.optimizer, new)]
        for p, name in zip(new, names):
            _claim(p, name, self)
        self._params.extend(new)
        self._names.extend(names)
        if self.world_size == 1 or not new:
            self._reset_round()
            return
        _check_same_params_on_all_ranks(new, names, self.process_group, self.root_rank)
        if self.bcast_period != -1:
            with torch.no_grad():
                collectives.broadcast_parameters(new, src=self.root_rank, group=self.process_group)
        ref = weakref.ref(self)
        start = len(self._params) - len(new)
        for index, p in enumerate(new, start):
            self._handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref, index)))
        # Reverse registration order is the usual arrival order; the root's observed order replaces it later.
        self._build_packs(list(reversed(range(len(self._params)))))
        self._planned = False
        self._reset_round()

    def _build_packs(self, order: Sequence[int]) -> None:
        metas = _metas(self._params)
        wire_dtype = _COMPRESSIONS[self.compression]
        packs = []
        pack_of = [0] * len(self._params)
        for k, spec in enumerate(plan_packs(order, metas, self.pack_threshold)):
            device, dtype = spec.key
            buffer = torch.empty(spec.numel + len(spec.members), dtype=dtype, device=device)
            views = [
                buffer[off : off + n].view(self._params[i].shape)
                for i, off, n in zip(spec.members, spec.offsets, spec.numels)
            ]
            wire = None
            if wire_dtype is not None and dtype in (torch.float32, torch.float64):
                wire = torch.empty(buffer.numel(), dtype=wire_dtype, device=device)
            params = [self._params[i] for i in spec.members]
            batched = spec.numel < _BATCH_GATHER_BELOW * len(spec.members)
            packs.append(_Pack(spec, buffer, buffer[: spec.numel], views, buffer[spec.numel :], params, batched, wire, []))
            for i in spec.members:
                pack_of[i] = k
        if self._packs:  # a re-plan: gradients move from the old buffers to the new ones
            for pack in packs:
                for p, view in zip(pack.params, pack.views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
        self._packs = packs
        self._pack_of = pack_of
        self._launch_order = LaunchOrder([len(pk.spec.members) for pk in packs])

    # ------------------------------------------------------------------ the hot path

    def _reset_round(self) -> None:
        self._state = _IDLE
        self._passes = 0
        self._pass_open = False
        self._pass_counts = False
        self._pass_reduces = False
        self._inflight: List[Tuple[Any, _Pack]] = []
        self._fired = bytearray(len(self._params))
        self._arrivals: List[int] = []
        self._launch_order.reset()
        for pack in self._packs:
            pack.absent.clear()

    def _on_grad_ready(self, index: int) -> None:
        with self._lock:
            if not self._pass_open:
                self._open_pass()
            if not self._pass_reduces:
                return
            if self._fired[index]:
                raise RuntimeError(
                    f"the gradient of {self._names[index]!r} was accumulated twice in one backward pass "
                    "after it was sent; distopt supports one gradient per parameter per backward"
                )
            self._fired[index] = 1
            if not self._planned:
                self._arrivals.append(index)
            for ready in self._launch_order.ready(self._pack_of[index]):
                self._launch(self._packs[ready])

    def _open_pass(self) -> None:
        """First hook of a backward pass: decide whether it reduces, and hook its end."""
        if self._passes >= self.backward_passes_per_step or self._state == _DONE:
            raise RuntimeError(
                f"backward() ran again after the gradients were averaged (backward_passes_per_step="
                f"{self.backward_passes_per_step}): call step() or zero_grad() before the next backward(), "
                f"or raise backward_passes_per_step to accumulate more passes (a reentrant "
                f"torch.utils.checkpoint also runs nested backward passes: use use_reentrant=False)"
            )
        self._pass_open = True
        self._pass_counts = self._sync_enabled  # no_sync passes do not count
        self._pass_reduces = self._pass_counts and self._passes == self.backward_passes_per_step - 1
        if self._pass_reduces:
            self._state = _ACTIVE
            self.stats = StepStats()
        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        with self._lock:
            self._pass_open = False
            self._passes += self._pass_counts
            if self._pass_reduces:
                self._flush()
                self._finish_round()

    def _adopt_grad(self, index: int, view: Tensor) -> bool:
        """Make ``.grad`` of parameter ``index`` the buffer view ``view``; False if it has none."""
        param = self._params[index]
        grad = param.grad
        scale = self._scale
        if grad is view:  # accumulated in place
            if scale is not None:
                view.mul_(scale)
            return True
        if grad is None:
            return False
        if grad.is_sparse:
            if not self.sparse_as_dense:
                raise RuntimeError(
                    f"parameter {self._names[index]!r} has a sparse gradient, which distopt does not reduce; "
                    "use dense gradients (e.g. nn.Embedding(..., sparse=False)) or pass sparse_as_dense=True"
                )
            grad = grad.to_dense()
        if scale is None:
            view.copy_(grad)
        else:
            torch.mul(grad, scale, out=view)
        param.grad = view
        return True

    def _gather(self, pack: _Pack) -> None:
        """Move the members' gradients into the pack's buffer, scaled; zeros where a member has none."""
        grads = [p.grad for p in pack.params]
        if pack.batched and all(
            g is not None and g is not v and not g.is_sparse for g, v in zip(grads, pack.views)
        ):
            # Many small gradients: one cat and one scale beat a copy per tensor.
            torch.cat([g.reshape(-1) for g in grads], out=pack.data)
            if self._scale is not None:
                pack.data.mul_(self._scale)
            for p, view in zip(pack.params, pack.views):
                p.grad = view
            return
        for j, index in enumerate(pack.spec.members):
            if not self._adopt_grad(index, pack.views[j]):
                pack.views[j].zero_()
                pack.absent.append(j)

    def _launch(self, pack: _Pack) -> None:
        self._gather(pack)
        pack.flags.fill_(1)
        for j in pack.absent:
            pack.flags[j] = 0
        buffer = pack.buffer
        if pack.wire is not None:
            pack.wire.copy_(buffer)
            buffer = pack.wire
        with torch.profiler.record_function("distopt.all_reduce"):
            work = dist.all_reduce(buffer, op=self._op, group=self.process_group, async_op=True)
        self._inflight.append((work, pack))
        self.stats.packs += 1
        self.stats.bytes += buffer.numel() * buffer.element_size()

    def _flush(self) -> None:
        """Launch every pack not launched yet, sending zeros for members without a gradient."""
        launched_before = self._launch_order.launched
        for k in self._launch_order.flush():
            self._launch(self._packs[k])
        self.stats.packs_at_flush = self._launch_order.launched - launched_before

    def _wait(self) -> None:
        if not self._inflight:
            return
        start = time.perf_counter()
        with torch.profiler.record_function("distopt.wait"):
            for work, _ in self._inflight:
                work.wait()
        self.stats.wait_seconds += time.perf_counter() - start

    def _finish_round(self) -> None:
        """Wait for every pack, scale, and settle which parameters end up with a gradient."""
        self._wait()
        for _, pack in self._inflight:
            if pack.wire is not None:
                pack.buffer.copy_(pack.wire)
            if pack.absent:
                present = pack.flags.tolist()
                for j in pack.absent:
                    # Averaged with zeros where some rank had a gradient; None where none had.
                    index = pack.spec.members[j]
                    self._params[index].grad = pack.views[j] if present[j] else None
                pack.absent.clear()
        self._inflight = []
        self._state = _DONE
        self._passes = self.backward_passes_per_step
        if not self._planned:
            self._fix_plan()

    def _fix_plan(self) -> None:
        """Adopt the root's observed gradient order as the plan on every rank.

        The message starts with how many arrivals the root saw: a round without
        any (gradients set by hand) leaves the plan open for the next round.
        """
        seen = set(self._arrivals)
        order = self._arrivals + [i for i in reversed(range(len(self._params))) if i not in seen]
        message = torch.tensor([len(self._arrivals)] + order, dtype=torch.int64)
        collectives.broadcast(message, src=self.root_rank, group=self.process_group)
        observed, *root_order = message.tolist()
        if not observed:
            return
        # Only which packs exist, and their order, matter to matching; keeping the buffers when
        # those are unchanged also spares a second set of buffers at the peak.
        plan = plan_packs(root_order, _metas(self._params), self.pack_threshold)
        if [set(spec.members) for spec in plan] != [set(pack.spec.members) for pack in self._packs]:
            self._build_packs(root_order)
        self._planned = True

    def _synchronizing(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def reduced_closure() -> Any:
            self._reset_round()  # each closure call is a fresh forward and backward
            with torch.enable_grad():
                loss = closure()
            self.synchronize()
            return loss

        return reduced_closure


# ---------------------------------------------------------------------- helpers


def _metas(params: Sequence[Tensor]) -> List[ParamMeta]:
    return [ParamMeta((p.device, p.dtype), p.numel(), p.element_size()) for p in params]


def _make_hook(ref: "weakref.ReferenceType[DistributedOptimizer]", index: int) -> Callable[[Tensor], None]:
    # A weak reference, so a dropped optimizer is collected and its hooks go quiet.
    def hook(param: Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._on_grad_ready(index)

    return hook


def _check_arguments(
    optimizer: Any,
    reduce_op: Any,
    pack_threshold: Any,
    bcast_period: Any,
    backward_passes_per_step: Any,
    compression: Any,
) -> None:
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain torch.optim optimizer once")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build it first, e.g. DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))"
        )
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"reduce_op must be 'mean' or 'sum', got {reduce_op!r}")
    if isinstance(pack_threshold, bool) or not isinstance(pack_threshold, int) or pack_threshold < 0:
        raise ValueError(
            f"pack_threshold must be a number of bytes >= 0 (0 sends each gradient alone), got {pack_threshold!r}"
        )
    if isinstance(bcast_period, bool) or not isinstance(bcast_period, int) or bcast_period < -1:
        raise ValueError(
            f"bcast_period must be an int >= -1 (N > 0: every N steps, 0: only at construction, -1: never), "
            f"got {bcast_period!r}"
        )
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise ValueError(
            f"backward_passes_per_step must be an int >= 1 (1 reduces after every backward), "
            f"got {backward_passes_per_step!r}"
        )
    if compression not in _COMPRESSIONS:
        raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")


def _names_by_id(
    named_parameters: Optional[Iterable[Tuple[str, Tensor]]], optimizer: Optimizer
) -> Dict[int, str]:
    if named_parameters is None:
        return {}
    pairs = list(named_parameters)
    names: Dict[int, str] = {}
    seen_names = set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], Tensor)):
            raise ValueError(
                f"named_parameters must be (name, parameter) pairs such as model.named_parameters(), got {pair!r}"
            )
        name, p = pair
        if name in seen_names:
            raise ValueError(f"named_parameters has the name {name!r} twice; every parameter needs its own name")
        if id(p) in names:
            raise ValueError(
                f"named_parameters lists one parameter under two names, {names[id(p)]!r} and {name!r}; "
                "list each parameter once"
            )
        seen_names.add(name)
        names[id(p)] = name
    unnamed = [f"param_groups[{g}][{j}]" for g, j, p in _positions(optimizer, None) if id(p) not in names]
    if unnamed:
        raise ValueError(
            f"named_parameters was given, but {len(unnamed)} of the optimizer's parameters have no name "
            f"(first: {unnamed[0]}); pass the model's named_parameters() for every parameter the optimizer holds"
        )
    return names


def _positions(optimizer: Optimizer, only: Optional[List[Tensor]]) -> List[Tuple[int, int, Tensor]]:
    wanted = None if only is None else {id(p) for p in only}
    return [
        (g, j, p)
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
        if wanted is None or id(p) in wanted
    ]


def _claim(param: Tensor, name: str, owner: DistributedOptimizer) -> None:
    current = getattr(param, _OWNER_ATTR, None)
    if current is not None and current() is not None and current() is not owner:
        raise ValueError(
            f"parameter {name!r} already belongs to another DistributedOptimizer; give each wrapper its own "
            "parameters, or call close() on the old wrapper first"
        )
    setattr(param, _OWNER_ATTR, weakref.ref(owner))


def _check_same_params_on_all_ranks(
    params: List[Tensor], names: List[str], group: Optional[ProcessGroup], root: int
) -> None:
    """Raise on every rank, naming the first parameter that differs from the root's."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)]
    everyone = collectives.all_gather_object(mine, group=group)
    reference = everyone[root]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a is None or b is None or a[1:] != b[1:]:
                what = a[0] if a is not None else b[0]
                raise ValueError(
                    f"the model differs between ranks: parameter {i} ({what!r}) is "
                    f"{_describe(a)} on rank {root} but {_describe(b)} on rank {rank}; build the same model "
                    f"({len(reference)} vs {len(theirs)} parameters) on every rank before wrapping the optimizer"
                )


def _describe(entry: Optional[Tuple[str, Tuple[int, ...], str]]) -> str:
    return "missing" if entry is None else f"shape {list(entry[1])} {entry[2]}"
