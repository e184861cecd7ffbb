"""``mode=distopt.ShardedState()`` (``shard_state=True``): each rank keeps the optimizer state of the
parameters it owns (ZeRO-1).

Gradients are averaged during backward exactly as in synchronous training (one
all-reduce per pack, every rank receiving the whole average), so everything that reads them between ``backward()`` and
``step()`` (clipping, ``GradScaler``) is unchanged, and ``.grad`` stays the
averaged gradient after the step, as unsharded. At ``step()`` the inner
optimizer runs over the parameters this rank owns
(:mod:`distopt.planning.ownership`): their groups' ``params`` lists are narrowed
for the call, so the optimizer creates state for those alone, keeps whole
tensors (LAMB's trust ratio, Adafactor and Muon work), and param groups keep
their hyperparameters. Then each owner sends its updated parameters to the other
ranks, point to point (a large parameter straight from its tensor into theirs),
all posted at once, both directions of each link busy
(:mod:`distopt.modes.parameter_share`). Every rank ends with every parameter,
bitwise alike and bitwise the unsharded wrapper's. When the share finishes is
the mode's ``share`` argument:

* ``share="in_step"`` (the default): ``step()`` waits for it before it returns,
  so the parameters are every rank's as soon as ``step()`` returns, whatever reads
  them (a weight EMA over ``model.parameters()``, a comparison, logging), as
  unsharded. The share's time is added to the step.
* ``share="background"``: the share runs on after ``step()`` returns, and each
  module's next forward waits only for the parameters it holds, so the share
  overlaps the next forward pass. ``model.state_dict()``, the next ``step()``,
  ``opt.synchronize()``, ``opt.sync_now()``, the drift check, the optimizer's
  state dicts, ``broadcast_parameters()``, the end of a join block and ``close()``
  finish the share first; code that reads or changes parameters any other way
  between ``step()`` and the next forward (a weight EMA, ``clamp_()``) must call
  ``opt.synchronize()`` first: it would read the previous step's values of the
  parameters other ranks own. A change made before the share finished raises.

Step hooks run around all of it (:mod:`distopt.modes.step_hooks`): where a step
post-hook is registered the share is finished before it runs, so post-hooks see
every parameter, as around an unsharded step.

The gradients sharded too (ZeRO-2): ``ShardedState(gradients=True)``, shorthand
``shard_state="gradients"``. The plan groups each pack's members by owner, so that
each rank's part of a pack is one contiguous chunk
(:func:`distopt.planning.packing.grouped_by_owner`), and each pack is
reduce-scattered in place to its owners as it launches during backward, in plan
order, its control flags in a small all-reduce of their own
(:meth:`distopt.engine.GradientEngine.scatter_to`). Once the round is back, the
``.grad`` of a parameter another rank owns is None; an inf or NaN in any rank's
slice is written into every rank's first owned gradient, so that ``GradScaler``
finds it and skips the step on every rank alike (with its scale lowered alike);
``opt.clip_grad_norm_()`` sums the owned gradients' norms over the ranks. The
owner steps and the parameters are shared as above: an all-reduce's bytes in all.
``backward_passes_per_step`` and ``no_sync()`` accumulate locally as without
sharding. In a ``join()`` block, the round in which a rank joined was
reduce-scattered to the owners it started with: the gradients of the parameters
whose owner changes go to their new owners with their state (below), and the packs
are grouped by the new owners from the next round on. A cast (``compression="fp16"``,
``"bf16"``, :class:`distopt.compression.Cast`) sends each chunk in its 16-bit dtype, the
mean's ``1/world`` applied before the cast, and the owner adds every rank's rounded chunk,
its own included, in the pack's dtype, in rank order. Not supported, and refused by name:
the other compressors (a codec's collectives assume the whole pack on every rank), fault
tolerance, and a world in which a rank owns no trainable parameter. Once a
rank has joined, ``opt.clip_grad_norm_()`` adds up the norms of the ranks still
training alone, point to point (the joined rank owns no gradient, and waits in a
round the others have not sent).

Join: a rank that has joined owns nothing. In the round in which it joined, which
every rank settles at the same point of its collectives, its shard is handed to
the ranks still training (:meth:`distopt.engine.GradientEngine.call_when_settled`). From
then on the ranks still training share their parameters between themselves,
point to point, so a joined rank takes part in their gradient rounds only,
whether or not they step after them (``GradScaler`` skips a step where it finds an
inf; a closure may run several rounds per step). At the end of the block it takes
the parameters of a rank that ran the longest, and the shards go back to their
owners.

``state_dict()`` gathers every rank's shard into the full state dict an
unsharded optimizer would have, which loads anywhere (a plain optimizer, an
unsharded wrapper, a sharded one at another world size). Before gathering, the
ranks meet in the store with a time limit, so a ``state_dict()`` called on one
rank only fails with an error instead of hanging. ``sharded_state_dict()`` is
this rank's shard alone; which shards load as they are is
:mod:`distopt.modes.shards`'s.

In a world of one there is nothing to divide: the mode trains as :class:`Synchronous`
does, and its shard is the whole state.
"""
from __future__ import annotations

import contextlib
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from torch.optim import optimizer as torch_optimizer

from .. import collectives
from ..collectives.optimizer_state import cpu_copy
from ..collectives.tensors import to_comm
from ..planning import drift
from ..planning.ownership import assign_owners
from ..transport import stalls
from . import shards
from .base import ModeContext
from .parameter_share import ParameterShare, held_by, launch_share
from .step_hooks import step_with_hooks
from .synchronous import Synchronous, synchronizing

__all__ = ["ShardedState", "NORM_TAG"]

#: The tag of the point-to-point transfers that add up the gradients' norms once a rank has joined
#: (:meth:`ShardedState.clip_grad_norm_`): below the reduce-scatter's
#: (:data:`distopt.engine.in_flight.SCATTER_TAG`) and far above the parameter share's, which count up from 0.
NORM_TAG = (1 << 24) - 1


class ShardedState(Synchronous):
    """Synchronous training with the optimizer state sharded over the ranks (ZeRO-1).

    Gradients are averaged during backward as in :class:`Synchronous`; at ``step()`` each rank
    steps, and keeps state for, the parameters it owns only, then the ranks share the updated
    parameters. ``state_dict()`` gathers the shards (every rank must call it);
    ``sharded_state_dict()`` is this rank's alone. ``shard_state=True`` is its shorthand.

    A mode object serves one wrapper.

    Args:
        gradients: shard the gradients too (ZeRO-2; shorthand ``shard_state="gradients"``): each
            pack is reduce-scattered to the owners of its members during backward instead of
            all-reduced, so after backward ``.grad`` is None for the parameters other ranks own;
            clip with ``opt.clip_grad_norm_()``, which sums the norms over the ranks.
        share: when the updated parameters have reached every rank. ``"in_step"`` (the default):
            before ``step()`` returns, so anything may read them right after it. ``"background"``:
            the share runs on after ``step()`` and each module's next forward waits for the
            parameters it holds, which hides the share behind the forward; code that reads or
            changes parameters outside the model's forward between ``step()`` and the next forward
            (a weight EMA over ``model.parameters()``, ``clamp_()``, a comparison) must call
            ``opt.synchronize()`` first, or it reads the previous step's values of the parameters
            other ranks own (a change raises). Every rank must pass the same.

    Raises:
        ValueError: ``share`` is neither ``"in_step"`` nor ``"background"``; (when the wrapper is built,
            with ``gradients=True``) compression other than a cast (``"fp16"``, ``"bf16"``), or a rank owning
            no trainable parameter.
        TypeError: ``gradients`` is not a bool.
        TypeError: (when the wrapper is built) the inner optimizer is ``LBFGS``, which keeps one
            history over all parameters together.
        ValueError: (when the wrapper is built) with ``fault_tolerance``: a replica that dies takes
            the only copy of its shard with it.

    Example::

        >>> model = Net()
        >>> opt = distopt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                                    mode=distopt.ShardedState())
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()                        # each rank steps its shard, then shares the parameters
        >>> torch.save(opt.state_dict(), "opt.pt")  # gathered on every rank: save it on one
    """

    reduces_in_backward = True

    #: The values of ``share``. Not ``overlap``: local SGD's ``overlap`` (``sync_overlap``) is a number of
    #: inner steps that a streaming sync runs behind; this says where the parameter share is finished.
    SHARES = ("in_step", "background")

    def __init__(self, share: str = "in_step", gradients: bool = False) -> None:
        if not isinstance(gradients, bool):
            raise TypeError(f"ShardedState(gradients={gradients!r}): gradients must be True or False")
        self.gradients = gradients
        if share not in self.SHARES:
            raise ValueError(
                f"ShardedState(share={share!r}): share must be 'in_step' (the default: step() returns with every "
                f"rank holding the updated parameters) or 'background' (the share runs on until the next forward; "
                f"call opt.synchronize() before reading parameters outside it)"
            )
        self.share = share
        self.rank = 0  # this rank and the world, once the wrapper's parameters are taken on (on_track)
        self.world_size = 1
        self.base_owner: Dict[int, int] = {}  # id(parameter) -> owning rank, from the parameter list alone
        self.owner_of: Dict[int, int] = {}  # the owners now: the base ones, but none that has joined
        self.loads: List[int] = []
        self.contributors = 1  # ranks still training when ownership was last settled
        self.active = [0]  # those ranks (the others have joined)
        self._stepping: Optional[List[List[Tensor]]] = None  # each group's params while _step_mine narrows them
        self.gathers = 0  # completed state_dict() gathers, to name the next meeting in the store
        self._share: Optional[ParameterShare] = None  # the last step's parameters still in flight
        self._seen: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules seen running a forward while it flew

    def __repr__(self) -> str:
        args = ([f"share={self.share!r}"] if self.share != "in_step" else []) + (["gradients=True"] if self.gradients
                                                                                 else [])
        return f"{type(self).__name__}({', '.join(args)})"

    def settings(self) -> Dict[str, Any]:
        # Both sides send the same, but a rank that waits in step() and one that does not are out of step.
        return {"shard_state": "gradients" if self.gradients else True, "shard_state_share": self.share}

    def check_compatible(self, *, optimizer: Optimizer, reduce_op: str, bcast_period: int,
                         fault_tolerant: bool) -> None:
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                f"{self.describe()} cannot shard LBFGS: it keeps one history over all parameters together; "
                "train it unsharded (the default, synchronous training)"
            )
        if fault_tolerant:
            raise ValueError(
                f"{self.describe()} cannot be combined with fault_tolerance: each rank holds the only copy of its "
                "shard of the optimizer state, so a replica that dies takes that shard with it and a replacement "
                "has no live peer to heal it from. Train unsharded (every replica keeps the whole state, as "
                "torchft's own replica groups do)"
            )

    def mine(self, p: Tensor) -> bool:
        return self.owner_of.get(id(p), self.rank) == self.rank

    def on_track(self, ctx: ModeContext, params: List[Tensor]) -> None:
        if not self.loads:  # the first parameters: the world is the wrapper's
            self.rank, self.world_size = ctx.rank, ctx.world_size
            self.loads = [0] * self.world_size
            self.contributors = self.world_size
            self.active = list(range(self.world_size))
        owners, self.loads = assign_owners([p.numel() * p.element_size() for p in params], self.world_size,
                                           self.loads)
        for p, rank in zip(params, owners):
            self.base_owner[id(p)] = self.owner_of[id(p)] = rank
        self._drop_foreign_state(ctx)
        if self.gradients and ctx.engine.owner_of is not None:  # parameters added later: re-planned by owner
            self._check_every_rank_owns_a_gradient(ctx)
            ctx.engine.scatter_to(ctx.engine.owner_of)

    def attach(self, ctx: ModeContext) -> None:
        if self.gradients:
            self._refuse_with_gradients(ctx)
        if ctx.world_size == 1:
            return
        # Weakly: the engine must not keep the mode, nor the context, alive.
        mode, context = weakref.ref(self), weakref.ref(ctx)

        def follow_joins() -> None:
            m, c = mode(), context()
            if m is not None and c is not None:
                if m.gradients:
                    m._after_scatter(c)
                m._follow_joins(c)

        ctx.engine.call_when_settled(follow_joins)
        if self.gradients:
            self._check_every_rank_owns_a_gradient(ctx)

            def owner(p: Tensor) -> int:
                # A parameter the engine takes on before this mode does (add_param_group) is planned with
                # rank 0 for owner on every rank, and re-planned once on_track has given it its owner.
                m = mode()
                return m.owner_of.get(id(p), 0) if m is not None else 0

            ctx.engine.scatter_to(owner)

    # ------------------------------------------------------------------ the gradients sharded too (ZeRO-2)

    def _refuse_with_gradients(self, ctx: ModeContext) -> None:
        """What sharded gradients do not support yet, refused when the wrapper is built."""
        what = f"{self.describe()} (the gradients reduce-scattered to their owners)"
        compressor = ctx.engine.config.compressor
        # A cast has no codec: the engine sends each rank's chunk in the wire dtype and the owner adds them up.
        if compressor is not None and not compressor.casts_only():
            raise ValueError(
                f"{what} cannot be compressed with {compressor!r}: a codec's collectives (and its error-feedback "
                "residuals) assume the whole pack on every rank, where a reduce-scatter leaves each rank its own "
                "chunk; the casts work (compression='fp16', 'bf16' or distopt.compression.Cast(...)), so use one "
                "of them, drop compression=, or shard the optimizer state only (shard_state=True)")

    def _check_every_rank_owns_a_gradient(self, ctx: ModeContext) -> None:
        """Every rank must own a trainable parameter: ``GradScaler`` finds an inf in the gradients a rank
        holds, and a rank holding none would neither skip nor lower its scale with the others."""
        owning = {self.owner_of[id(p)] for p in ctx.params if p.requires_grad}
        idle = [r for r in range(self.world_size) if r not in owning]
        if idle:
            raise ValueError(
                f"{self.describe()} at world size {self.world_size}: ranks {idle} own no trainable parameter "
                "(there are fewer trainable parameters than ranks, by bytes), so they would hold no gradient; "
                "train on fewer ranks, or shard the optimizer state only (shard_state=True)")

    def _after_scatter(self, ctx: ModeContext) -> None:
        """A round is back (on every rank, at the same point): make an inf or NaN found in any rank's slice show
        in every rank's, so that ``GradScaler`` skips the step everywhere alike."""
        if ctx.engine.exchange.fill is not None:
            return
        # The engine has let go of the others' gradients already (GradientEngine.scatter_to).
        owned = [p.grad for p in ctx.params if p.grad is not None and self.mine(p) and p.grad.numel()]
        with torch.no_grad():
            # The largest magnitude is inf or NaN exactly where a value is: a reduction, where isfinite(g)
            # would make temporaries the size of the gradient (47 MiB at a 64 MiB gradient).
            largest = [torch.linalg.vector_norm(g, float("inf")) for g in owned]
            local = bool(owned) and not bool(torch.isfinite(torch.stack(largest)).all())
            first_owned = owned[0] if owned else None
            flag = torch.tensor([float(local)], dtype=torch.float64)
            with stalls.inspected(ctx.progress, "the exchange of whether a gradient slice is not finite"):
                collectives.all_reduce(flag, op="sum", group=ctx.engine.channel.group)
            if flag.item() and not local and first_owned is not None:
                first_owned.view(-1)[0] = float("inf")

    def clip_grad_norm_(self, ctx: ModeContext, max_norm: float, norm_type: float) -> Tensor:
        if not self.gradients or ctx.world_size == 1:
            return super().clip_grad_norm_(ctx, max_norm, norm_type)
        # The last step's share (share="background") is done with before the norm's own transfers start.
        self._finish_share()
        grads = [p.grad for group in ctx.optimizer.param_groups for p in group["params"]
                 if p.grad is not None and self.mine(p)]
        with torch.no_grad():
            if norm_type == float("inf"):
                local = max((g.detach().abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
                total_norm = self._combine_over_training_ranks(ctx, local, "max")
            else:
                norms = [torch.linalg.vector_norm(g.detach(), norm_type).double() for g in grads]
                local = sum((n ** norm_type for n in norms), torch.zeros((), dtype=torch.float64))
                total_norm = self._combine_over_training_ranks(ctx, local, "sum") ** (1.0 / norm_type)
            coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return total_norm

    def _combine_over_training_ranks(self, ctx: ModeContext, value: Tensor, op: str) -> Tensor:
        """``value`` (a float64 scalar) summed, or its maximum taken, over the ranks still training, the
        same on each of them.

        Before any rank has joined this is an all-reduce. Once one has, it waits in a shadow round for
        the others' next round, and an all-reduce would meet that round instead: the ranks still
        training (the same list on each, :meth:`_follow_joins`) send their values to each other point
        to point, which a joined rank takes no part in, and each adds them up in rank order, so every
        one of them gets the same bits. A joined rank owns no gradient: it has nothing to add.
        """
        what = "the sum of the gradients' norms (clip_grad_norm_)"
        if len(self.active) == self.world_size:
            total = value.reshape(1).clone()
            with stalls.inspected(ctx.progress, what):
                collectives.all_reduce(total, op=op, group=ctx.engine.channel.group)
            return total[0]
        if self.rank not in self.active:
            return value
        group = ctx.engine.channel.group
        mine = to_comm(value.reshape(1).clone(), group)
        values = {self.rank: mine}
        works = []
        progress = ctx.progress
        # Point-to-point transfers are not collectives of the group: a rank that has joined issues none.
        aside = progress.aside() if progress is not None else contextlib.nullcontext()
        with aside:
            for peer in self.active:
                if peer != self.rank:
                    works.append(group.send([mine], peer, NORM_TAG))
                    values[peer] = torch.empty_like(mine)
                    works.append(group.recv([values[peer]], peer, NORM_TAG))
            with stalls.inspected(progress, what):
                for work in works:
                    work.wait()
        ordered = [values[r].to(value.device)[0] for r in sorted(values)]
        if op == "max":
            return torch.stack(ordered).max()
        total = ordered[0]
        for v in ordered[1:]:
            total = total + v
        return total

    def step(self, ctx: ModeContext, closure: Optional[Callable[[], Any]]) -> Any:
        if ctx.world_size == 1:  # nothing to divide
            return super().step(ctx, closure)
        self._finish_share()  # the last step's: this one changes the parameters it sent
        if closure is None:
            ctx.reduce_for_step()
        else:
            closure = self._whole_groups(ctx, synchronizing(ctx, closure))

        def body(step: Callable[..., Any], args: Any, kwargs: Any) -> Any:
            loss = self._step_mine(ctx, lambda: step(*args, **kwargs))
            self._launch_share(ctx)
            if self.share == "in_step":
                self._finish_share()  # launched all at once, both directions; step() returns with every parameter
            elif ctx.optimizer._optimizer_step_post_hooks or torch_optimizer._global_optimizer_post_hooks:
                self._finish_share()  # a post-hook (a weight EMA) reads every parameter
            return loss

        # The step hooks run around the whole step, as around an unsharded one: the pre-hooks and
        # post-hooks see every parameter, the post-hooks after every rank's have arrived.
        return step_with_hooks(ctx.optimizer, closure, body)

    def leaving(self, ctx: ModeContext) -> Optional[Callable[[], None]]:
        self._finish_share()  # before this rank's shadow rounds: it sends nothing more
        return None

    def kept_identical(self, ctx: ModeContext, scheduled: bool) -> Optional[drift.Kept]:
        # Every rank holds its own shard of the state; the parameters and the hyperparameters
        # (every rank keeps every param group) are the same everywhere after each step.
        self._finish_share()
        return drift.Kept(
            per_param=[[(drift.PARAMETER, p)] for p in ctx.params],
            shared=drift.hyperparameter_items(ctx.optimizer) + [("the step count", ctx.steps)],
            what="the parameters, the optimizer's hyperparameters and the step count (not the optimizer state: "
                 "each rank holds its own shard of it)",
        )

    def settle_after_join(self, ctx: ModeContext, last: int, identical: bool) -> None:
        # Every shard was stepped by a rank still training, but the ranks that joined early took no
        # part in the exchanges since: they take rank ``last``'s parameters. Then the shards go back
        # to their owners by the parameter list.
        self._finish_share()
        if not identical:
            what = "the parameter broadcast at the end of the join block"
            with torch.no_grad(), stalls.inspected(ctx.progress, what):
                collectives.broadcast_parameters(ctx.params, src=last, group=ctx.group)
            # The hyperparameters too: a joined rank's LR scheduler was not advanced.
            groups = [[{k: v for k, v in g.items() if k != "params"} for g in ctx.optimizer.param_groups]]
            with stalls.inspected(ctx.progress, "the hyperparameter broadcast at the end of the join block"):
                collectives.broadcast_object_list(groups, src=last, group=ctx.group)
            for group, theirs in zip(ctx.optimizer.param_groups, groups[0]):
                group.update(theirs)
        if self.owner_of != self.base_owner:
            self._move_state(ctx, dict(self.base_owner))
        self.contributors = self.world_size
        self.active = list(range(self.world_size))

    # ------------------------------------------------------------------ ranks that join

    def _follow_joins(self, ctx: ModeContext) -> None:
        """When the number of ranks still training changes, hand the shards of the joined ones over.

        Called once every round's control flags are read, on every rank (a joined rank's shadow
        round included), so the hand-over comes at the same point of every rank's collectives.
        """
        contributors = ctx.engine.outcome.contributors
        if contributors == self.contributors or contributors == 0:
            return
        self.contributors = contributors
        flag = torch.tensor([int(not ctx.engine.join.joined)], dtype=torch.int64)
        with stalls.inspected(ctx.progress, "the exchange of which ranks have joined"):
            flags = collectives.all_gather(flag, group=ctx.group)
        active = self.active = [r for r, f in enumerate(flags) if f.item()]
        params = ctx.params
        orphans = [p for p in params if self.base_owner[id(p)] not in active]
        new_owner = dict(self.base_owner)
        if orphans:  # deterministic on every rank: spread them over the active ranks by bytes
            loads = [sum(p.numel() * p.element_size() for p in params if self.base_owner[id(p)] == r) for r in active]
            owners, _ = assign_owners([p.numel() * p.element_size() for p in orphans], len(active), loads)
            for p, k in zip(orphans, owners):
                new_owner[id(p)] = active[k]
        self._move_state(ctx, new_owner)
        if self.gradients:  # the packs grouped by the new owners, from the next round on
            ctx.engine.scatter_to(ctx.engine.owner_of)

    def _move_state(self, ctx: ModeContext, new_owner: Dict[int, int]) -> None:
        """Send the state of every parameter whose owner changes to its new owner (one gather).

        With the gradients sharded, this round's averaged gradient of such a parameter is on its old
        owner alone (the round was reduce-scattered to the owners it started with): it travels too.
        """
        optimizer = ctx.optimizer
        index = {id(p): i for i, p in enumerate(ctx.params)}
        moving = [p for p in ctx.params if self.owner_of[id(p)] == self.rank != new_owner[id(p)]]
        outgoing = {index[id(p)]: cpu_copy(optimizer.state[p]) for p in moving if p in optimizer.state}
        grads = {}
        if self.gradients:
            grads = {index[id(p)]: p.grad.detach().cpu().clone() for p in moving if p.grad is not None}
        with stalls.inspected(ctx.progress, "the hand-over of optimizer state between ranks"):
            everyone = collectives.all_gather_object((outgoing, grads), group=ctx.group)
        self.owner_of = new_owner
        for part, part_grads in everyone:
            for i, state in part.items():
                p = ctx.params[i]
                if self.mine(p):
                    optimizer.state[p] = {k: v.to(p.device) if isinstance(v, Tensor) else v for k, v in state.items()}
            for i, grad in part_grads.items():
                p = ctx.params[i]
                if self.mine(p):
                    p.grad = grad.to(device=p.device, dtype=p.dtype)
        for p in moving:  # another rank's now
            if self.gradients:
                p.grad = None
        self._drop_foreign_state(ctx)

    # ------------------------------------------------------------------ the step

    def _step_mine(self, ctx: ModeContext, step: Callable[[], Any]) -> Any:
        """Call ``step`` (the inner optimizer's) with every param group narrowed to this rank's parameters."""
        groups = ctx.optimizer.param_groups
        saved = self._stepping = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if self.mine(p)]
            return step()
        finally:
            self._stepping = None
            for group, params in zip(groups, saved):
                group["params"] = params

    def _whole_groups(self, ctx: ModeContext, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` run with the param groups whole, as it was written: its ``zero_grad()`` clears
        every gradient, not this rank's shard's only (an optimizer that calls it twice would otherwise
        add the first call's averaged gradients to the second's). The inner step then goes on with
        this rank's shard as it is after the closure's round, in which a rank may have joined."""
        def whole() -> Any:
            saved = self._stepping
            if saved is None:  # called outside the inner step
                return closure()
            groups = ctx.optimizer.param_groups
            for group, params in zip(groups, saved):
                group["params"] = params
            try:
                return closure()
            finally:
                for group, params in zip(groups, saved):
                    group["params"] = [p for p in params if self.mine(p)]

        return whole

    def _launch_share(self, ctx: ModeContext) -> None:
        """Start sending the parameters this rank stepped to the other ranks still training, and receiving
        theirs, without waiting (:mod:`distopt.modes.parameter_share`): ``step()`` waits for all of it
        (``share="in_step"``), or the next forward waits per module and :meth:`finish_step` for all
        (``share="background"``).

        Every parameter travels point to point from its owner to the others (small ones together), in
        the reverse of the plan's order (about the order of the next forward), the same on every rank. Each rank
        receives only what others updated. Once a rank has joined, the ranks still training share
        between themselves: the joined ranks take no part, so they need not know whether the others
        stepped after a round.
        """
        engine = ctx.engine
        order = [p for pack in reversed(engine.packs) for p in reversed(pack.params)]
        share = launch_share(order, self.owner_of, self.rank, self.active, engine.channel.group, engine.progress,
                             ctx.names)
        if share is None:
            return
        self._share = share
        engine.stats.bytes += share.sent_bytes
        engine.stats.parameter_bytes = share.sent_bytes
        if self.share != "background":
            return  # finished before step() returns
        mode = weakref.ref(self)

        def on_module(module: nn.Module) -> None:
            m = mode()
            if m is not None:
                m._before_forward(module)

        share.watch_forward(on_module)

    def _before_forward(self, module: nn.Module) -> None:
        """A module's forward is about to run while a share is in flight: wait for the parameters it holds."""
        share = self._share
        if share is None:
            return
        share.wait_for(held_by(module))
        if module not in self._seen:
            self._seen.add(module)
            if any(id(p) in self.owner_of for p in module.parameters()):
                self._guard(module)

    def _guard(self, module: nn.Module) -> None:
        """Have ``module.state_dict()`` finish the share first (a checkpoint right after ``step()``).

        Every module that runs a forward while a share is in flight and holds a tracked parameter,
        however deep, is guarded once, the model itself first: its forward starts before any of its
        modules', so it is guarded even where the share arrives before the forward reaches the rest.
        """
        mode = weakref.ref(self)

        def before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            m = mode()
            if m is not None:
                m._finish_share()

        module.register_state_dict_pre_hook(before_state_dict)

    def finish_step(self, ctx: ModeContext) -> None:
        """Wait until every rank holds every updated parameter of the last step (``opt.synchronize()``)."""
        self._finish_share()

    def _finish_share(self) -> None:
        share, self._share = self._share, None
        if share is not None:
            share.finish()

    # ------------------------------------------------------------------ state dicts

    def gathers_state(self, ctx: ModeContext) -> bool:
        return ctx.world_size > 1

    def state_dict(self, ctx: ModeContext) -> Dict[str, Any]:
        """The full state dict, gathered from every rank's shard (every rank must call it)."""
        self._finish_share()
        local = ctx.optimizer.state_dict()
        if ctx.world_size == 1:
            return local
        self._meet(ctx, "state_dict()")
        with stalls.inspected(ctx.progress, "the gather of the optimizer state's shards"):
            shards = collectives.all_gather_object(cpu_copy(local["state"]), group=ctx.group)
        self.gathers += 1
        state: Dict[int, Any] = {}
        for shard in shards:
            state.update(shard)
        return {"state": {k: state[k] for k in sorted(state)}, "param_groups": local["param_groups"]}

    def sharded_state_dict(self, ctx: ModeContext) -> Optional[Dict[str, Any]]:
        """This rank's shard alone, with no communication; :func:`merge_state_dicts` joins a save's shards.
        In a world of one it is the whole state."""
        self._finish_share()
        if ctx.world_size == 1:
            return shards.shard_of(ctx.optimizer, 0, 1, [0] * sum(len(g["params"]) for g in ctx.optimizer.param_groups))
        return shards.shard_of(ctx.optimizer, self.rank, self.world_size, self._owners(ctx))

    def load_state_dict(self, ctx: ModeContext, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (from any world size, sharded or not), or this rank's own shard of the
        same world size and owners (checked: see :func:`distopt.modes.shards.check_shard`), and keep this
        rank's shard."""
        self._finish_share()
        if ctx.world_size == 1:
            super().load_state_dict(ctx, state_dict)
            return
        if shards.SHARD_KEY in state_dict:
            names = [ctx.name_of(p, g, j)
                     for g, group in enumerate(ctx.optimizer.param_groups) for j, p in enumerate(group["params"])]
            shards.check_shard(state_dict, self.rank, self.world_size, self._owners(ctx), names)
            state_dict = {k: v for k, v in state_dict.items() if k != shards.SHARD_KEY}
        ctx.optimizer.load_state_dict(state_dict)
        self._drop_foreign_state(ctx)

    def broadcast_optimizer_state(self, ctx: ModeContext, src: int) -> None:
        if ctx.world_size == 1:
            return
        raise RuntimeError(
            f"broadcast_optimizer_state() with {self.describe()}: each rank holds its own shard, so the root's "
            "state is not everyone's; load a full state dict on every rank with opt.load_state_dict() instead"
        )

    def _owners(self, ctx: ModeContext) -> List[int]:
        """Each parameter's owner now, in state-dict order (-1: not tracked, stepped by every rank)."""
        return [self.owner_of.get(id(p), -1) for group in ctx.optimizer.param_groups for p in group["params"]]

    def _drop_foreign_state(self, ctx: ModeContext) -> None:
        for p in list(ctx.optimizer.state):
            if not self.mine(p):
                del ctx.optimizer.state[p]

    def _meet(self, ctx: ModeContext, what: str) -> None:
        """Wait in the store until every rank has called ``what``; raise, naming the absent, if they do not."""
        progress = ctx.progress
        store = stalls.main_store()
        if store is None or progress is None:
            return
        limit = ctx.stall_timeout or ctx.stall_warning or 60.0
        prefix = f"distopt/{progress.group}/meet/{self.gathers}"
        store.set(f"{prefix}/{self.rank}", "here")
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        try:
            store.wait(keys, timedelta(seconds=limit))
        except Exception:
            absent = [r for r, key in enumerate(keys) if not store.check([key])]
            store.delete_key(f"{prefix}/{self.rank}")
            error = RuntimeError(
                f"{what} with {self.describe()} gathers every rank's shard of the optimizer state, but ranks "
                f"{absent} did not call it within {limit:g} s: call opt.{what[:-2]}() on every rank at the same "
                "point (then save it on one rank only)"
            )
            # A rank that exits on this error (Hydra turns it into sys.exit(1)) did not finish: the others,
            # waiting for it in their own collectives, are told where it was.
            progress.fail(f"the gathering of the sharded state dict ({what})", error)
            raise error from None
