"""Local SGD and DiLoCo: every rank trains alone, and the ranks meet every ``sync_every`` steps.

Between two syncs no gradient is reduced: backward leaves ``.grad`` as this
rank's own gradient and the inner optimizer steps on it. Every ``sync_every``-th
step (after ``local_warmup`` synchronous steps) the ranks average their progress
since the last sync, the *pseudo-gradient* ``anchor - param`` (the parameters at
the last sync minus the parameters now, so it points the way a gradient does):

- **plain averaging** (no outer optimizer, torch's ``PostLocalSGDOptimizer``):
  ``param = anchor - mean(anchor - param_r)``, the mean of the ranks' parameters;
- **DiLoCo** (Douillard et al. 2023): the mean pseudo-gradient is the gradient
  of the anchors for the *outer optimizer* (e.g. Nesterov SGD, lr 0.7,
  momentum 0.9); every rank steps it alike and takes its result.

The pseudo-gradients travel through the engine's packs, in its fixed plan, one
all-reduce per pack (:mod:`distopt.exchange`).
Sending the change rather than the parameters means that ``compression``
rounds only the change: the anchors stay exact, and every rank applies the same
rounded mean to the same anchor, so the ranks are bitwise identical after
every sync. The extra memory is one copy of the trainable parameters (the
anchors) plus the outer optimizer's state (a momentum buffer each for SGD);
:attr:`distopt.StepStats.extra_state_bytes` reports it.

Join: a rank that runs out of data with local steps since the last sync sends
them in one last exchange, as a contributor, then shadows the others'
exchanges with zeros and a contributing flag of 0; each exchange averages over
the ranks that contributed to it.

Checkpoints, and taking one rank's state (the end of a join block,
``broadcast_optimizer_state()``), are in :mod:`distopt.modes.local_sgd_state`;
``GradScaler``, which must not skip a step on one rank only, in
:mod:`distopt.modes.amp`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..exchange import finish_exchange, launch_exchange
from ..stats import StepStats
from . import amp, local_sgd_state
from .base import Mode
from .synchronous import SynchronousMode

if TYPE_CHECKING:
    from ..optimizer import DistributedOptimizer
    from ..packs import Pack

__all__ = ["LocalSGDMode", "STATE_KEY", "OuterFactory"]

STATE_KEY = local_sgd_state.STATE_KEY

#: Builds the outer optimizer from the tensors it steps (the parameters at the last sync).
OuterFactory = Callable[[Iterable[Tensor]], Optimizer]


class LocalSGDMode(Mode):
    """Train locally, average (or take an outer step on) the pseudo-gradient every ``sync_every`` steps.

    Args:
        sync_every: local steps between two syncs (H).
        outer_optimizer: builds the outer optimizer (DiLoCo) from the anchors; None
            averages the parameters.
        local_warmup: synchronous steps before the first local one (W).
    """

    def __init__(self, sync_every: int, outer_optimizer: Optional[OuterFactory], local_warmup: int) -> None:
        self.sync_every = sync_every
        self.local_warmup = local_warmup
        self.reduces_in_backward = local_warmup > 0  # per instance: true during the warm-up only
        self.outer: Optional[Optimizer] = None  # built by the factory from the anchors
        self.since_sync = 0  # local steps since the last sync
        self._factory = outer_optimizer
        self._synchronous = SynchronousMode()
        self._anchors: Dict[int, Tensor] = {}  # id(parameter) -> its value at the last sync
        self._seen = 0  # the owner's parameters looked at for anchors
        self._untracked: List[Tensor] = []  # parameters without an anchor, frozen when looked at
        self._extra_bytes = 0

    # ------------------------------------------------------------------ the seam

    def settings(self) -> Dict[str, Any]:
        # A factory cannot be compared across processes; whether there is one can.
        return {"sync_every": self.sync_every, "local_warmup": self.local_warmup,
                "outer_optimizer": self._factory is not None}

    def attach(self, owner: "DistributedOptimizer") -> None:
        owner._engine.forbid_rows()
        self._track(owner)
        self._set_local(owner, owner._steps >= self.local_warmup)

    def step(self, owner: "DistributedOptimizer", closure: Optional[Callable[[], Any]]) -> Any:
        step = owner._steps
        warm = step < self.local_warmup
        if warm and amp.handed_over(owner):
            owner._reduce_for_step()  # unscale the averaged gradients, not local ones the reduction would replace
        # GradScaler hands every step over (``_step_supports_amp_scaling``): one rank's inf skips its
        # inner step only, and the step still counts, so the ranks' syncs stay paired.
        skip = amp.unscale_or_skip(owner)
        if warm:
            loss = None if skip else self._synchronous.step(owner, closure)
            if step + 1 == self.local_warmup:  # the next backward already stays local
                self._track(owner)
                with torch.no_grad():
                    for p, anchor in self._pairs(owner):
                        anchor.copy_(p)  # identical on every rank after synchronous steps
                self._set_local(owner, True)
            return loss
        owner._engine.stats = StepStats()  # nothing on the wire, unless this step syncs
        self._track(owner)
        if skip:
            loss = None
        else:
            loss = owner.optimizer.step() if closure is None else owner.optimizer.step(closure)
        self.since_sync += 1
        if self.since_sync >= self.sync_every:
            self._sync(owner)
        return loss

    def leaving(self, owner: "DistributedOptimizer") -> Optional[Callable[[], None]]:
        # Steps not averaged yet are sent once, as a contributor; a rank without any just shadows.
        if owner.world_size == 1 or not owner._engine.local or self.since_sync == 0:
            return None
        self.since_sync = 0
        self._launch(owner)
        return lambda: self._finish(owner)

    def broadcast_state(self, owner: "DistributedOptimizer", src: int) -> None:
        # The end of a join block, and broadcast_optimizer_state(): every rank takes ``src``'s step
        # count, steps since the last sync, anchors and outer optimizer, whatever its own history.
        local_sgd_state.broadcast(self, owner, src)

    def state_dict(self, owner: "DistributedOptimizer") -> Dict[str, Any]:
        return local_sgd_state.save(self, owner)

    def load_state_dict(self, owner: "DistributedOptimizer", state_dict: Dict[str, Any]) -> None:
        local_sgd_state.load(self, owner, state_dict)

    def extra_state_bytes(self, owner: "DistributedOptimizer") -> int:
        return self._extra_bytes

    # ------------------------------------------------------------------ the sync

    def _sync(self, owner: "DistributedOptimizer") -> None:
        self.since_sync = 0
        if not self._needs_anchors(owner):  # plain averaging over one rank changes nothing
            return
        if owner.world_size > 1:
            self._launch(owner)
            self._finish(owner)
            return
        with torch.no_grad():  # DiLoCo in one process: the pseudo-gradient is this rank's own
            self._apply([(p, anchor, anchor - p) for p, anchor in self._pairs(owner)])

    def _launch(self, owner: "DistributedOptimizer") -> None:
        engine = owner._engine
        scale = engine.scale

        def fill(pack: "Pack") -> None:
            for p, view in zip(pack.params, pack.views):
                if p.grad is view:  # left by a synchronous round: .grad stays this rank's own gradient
                    p.grad = view.clone()
                torch.sub(self._anchor_of(p), p.detach(), out=view)
                if scale is not None:  # before a 16-bit cast, as for gradients
                    view.mul_(scale)

        if engine.progress is not None:
            engine.progress.phase = "inside step() (local SGD: averaging the pseudo-gradients)"
        with torch.no_grad():
            launch_exchange(engine, fill)

    def _finish(self, owner: "DistributedOptimizer") -> None:
        engine = owner._engine
        with torch.no_grad():
            finish_exchange(engine)
            self._apply([(p, self._anchor_of(p), view)
                         for pack in engine.packs for p, view in zip(pack.params, pack.views)])

    def _apply(self, items: List[Tuple[Tensor, Tensor, Tensor]]) -> None:
        """Move the anchors by the mean pseudo-gradient and give the parameters their values."""
        if self.outer is None:
            for _, anchor, pseudo in items:
                anchor.sub_(pseudo)
        else:
            for _, anchor, pseudo in items:
                anchor.grad = pseudo
            self.outer.step()
            for _, anchor, _ in items:
                anchor.grad = None  # the pack views are reused by the next exchange
        for p, anchor, _ in items:
            p.copy_(anchor)
        self._count_bytes()

    # ------------------------------------------------------------------ anchors

    def _needs_anchors(self, owner: "DistributedOptimizer") -> bool:
        return owner.world_size > 1 or self._factory is not None

    def _set_local(self, owner: "DistributedOptimizer", local: bool) -> None:
        self.reduces_in_backward = not local
        owner._engine.local = local

    def _pairs(self, owner: "DistributedOptimizer") -> List[Tuple[Tensor, Tensor]]:
        return [(p, self._anchors[id(p)]) for p in owner._params if id(p) in self._anchors]

    def _track(self, owner: "DistributedOptimizer") -> None:
        """Give an anchor to every trainable parameter without one (new groups, unfrozen parameters)."""
        params = owner._params
        if not self._needs_anchors(owner) or (
            len(params) == self._seen and not any(p.requires_grad for p in self._untracked)
        ):
            return
        self._new_anchors([p for p in params if p.requires_grad and id(p) not in self._anchors])
        self._untracked = [p for p in params if id(p) not in self._anchors]
        self._seen = len(params)
        self._count_bytes()

    def _anchor_of(self, p: Tensor) -> Tensor:
        anchor = self._anchors.get(id(p))
        return anchor if anchor is not None else self._new_anchors([p])[0]

    def _new_anchors(self, params: List[Tensor], grouped: bool = True) -> List[Tensor]:
        """Copy ``params`` as they are now (the same on every rank: a sync or the broadcast left them so).

        Args:
            params: parameters without an anchor.
            grouped: give the anchors to the outer optimizer (False: the caller places them).
        """
        anchors = [p.detach().clone() for p in params]
        self._anchors.update((id(p), a) for p, a in zip(params, anchors))
        if anchors and grouped and self._factory is not None:
            self._give_outer(anchors)
        return anchors

    def _give_outer(self, anchors: List[Tensor]) -> None:
        """Build the outer optimizer over ``anchors``, or add them as a new param group (the factory's defaults)."""
        if self.outer is None:
            self.outer = _build_outer(self._factory, anchors)
        else:  # a new param group, or a parameter unfrozen since
            self.outer.add_param_group({"params": anchors})

    def _count_bytes(self) -> None:
        tensors = list(self._anchors.values())
        if self.outer is not None:
            tensors += [v for state in self.outer.state.values() for v in state.values() if torch.is_tensor(v)]
        self._extra_bytes = sum(t.numel() * t.element_size() for t in tensors)


def _build_outer(factory: OuterFactory, anchors: List[Tensor]) -> Optimizer:
    """Call the user's factory and check that it built an optimizer over the tensors it was given.

    Raises:
        TypeError: it returned no ``torch.optim.Optimizer``.
        ValueError: the optimizer holds other tensors (e.g. ``model.parameters()``).
    """
    outer = factory(anchors)
    if not isinstance(outer, Optimizer):
        raise TypeError(
            f"outer_optimizer must return a torch.optim.Optimizer, got {type(outer).__name__}; e.g. "
            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
        )
    held = {id(p) for group in outer.param_groups for p in group["params"]}
    if held != {id(a) for a in anchors}:
        raise ValueError(
            "outer_optimizer must build its optimizer over the tensors it is given (distopt's copies of the "
            "parameters at the last sync), not over the model's parameters; write "
            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
        )
    return outer
