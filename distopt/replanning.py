"""Changing the engine's plan once a round is back, on every rank together.

Two things change the plan, and both are decided from what every rank read in
the same round, so every rank changes it at the same point:

- **The root's observed order** (:func:`fix_plan`). After the first reducing
  round, the root broadcasts the order its gradients arrived in and every rank
  rebuilds the same packs from it, so that packs fill in arrival order.
- **Unfrozen parameters** (:func:`adopt_unfrozen`). A parameter frozen when the
  wrapper took it on and trainable now raised a control flag; the ranks compare
  which they unfroze, hook them, re-plan and reduce the round again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import collectives, stalls
from .packing import plan_packs
from .packs import metas

if TYPE_CHECKING:
    from .engine import GradientEngine

__all__ = ["fix_plan", "adopt_unfrozen"]


def fix_plan(engine: "GradientEngine") -> None:
    """Adopt the root's observed gradient order as the plan on every rank.

    The message starts with how many arrivals the root saw: a round without
    any (gradients set by hand, or a root that has joined) leaves the plan open.
    """
    seen = set(engine.arrivals)
    order = engine.arrivals + [i for i in reversed(range(len(engine.params))) if i not in seen]
    message = torch.tensor([len(engine.arrivals)] + order, dtype=torch.int64)
    with stalls.inspected(engine.progress, "the broadcast of the pack plan"):
        collectives.broadcast(message, src=engine.root_rank, group=engine.channel.group)
    observed, *root_order = message.tolist()
    if not observed:
        return
    # Only which packs exist, and their order, matter to matching; keeping the buffers when
    # those are unchanged also spares a second set of buffers at the peak.
    plan = plan_packs(root_order, metas(engine.params), engine.pack_threshold)
    if [set(spec.members) for spec in plan] != [set(pack.spec.members) for pack in engine.packs]:
        engine.build_packs(root_order)
    engine.planned = True


def adopt_unfrozen(engine: "GradientEngine") -> None:
    """Track the parameters every rank unfroze, and reduce this round again with them.

    A rank that has joined sends None and follows the others.

    Raises:
        ValueError: the ranks unfroze different parameters.
    """
    frozen, frozen_names = engine.frozen, engine.frozen_names
    # A frozen parameter with a gradient set by hand (torch.func.grad, say) is stepped by the inner
    # optimizer like a trainable one, so it is averaged like one.
    mine = None if engine.joined else [
        (n, "trainable" if p.requires_grad else "frozen, with a gradient set by hand")
        for p, n in zip(frozen, frozen_names) if p.requires_grad or p.grad is not None
    ]
    with stalls.inspected(engine.progress, "the exchange of unfrozen parameter names"):
        everyone = collectives.all_gather_object(mine, group=engine.channel.group)
    named = [theirs for theirs in everyone if theirs is not None]
    if any(theirs != named[0] for theirs in named):
        detail = "; ".join(f"rank {r}: {dict(theirs)}" for r, theirs in enumerate(everyone) if theirs is not None)
        raise ValueError(
            f"different ranks made different frozen parameters trainable or gave them gradients ({detail}); set "
            "requires_grad, and any gradient set by hand, alike on every rank, at the same step"
        )
    adopted = dict(named[0])
    if mine is None:
        for p, n in zip(frozen, frozen_names):
            if adopted.get(n) == "trainable":
                p.requires_grad_(True)
    params = [p for p, n in zip(frozen, frozen_names) if n in adopted]
    names = [n for n in frozen_names if n in adopted]
    engine.frozen = [p for p, n in zip(frozen, frozen_names) if n not in adopted]
    engine.frozen_names = [n for n in frozen_names if n not in adopted]
    # The other gradients are averaged already. The round is sent again in the new plan, for the
    # unfrozen ones, and then the others get their averaged values back: sent again, a sum
    # would be summed twice and a join's rescale applied twice. A copy of them, once per unfreeze.
    final = [(p, p.grad.detach().clone()) for p in engine.params if p.grad is not None]
    engine.hook(params, names)  # re-plans; the gradients move into the new packs
    engine.reduce_again()
    for p, grad in final:
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)
