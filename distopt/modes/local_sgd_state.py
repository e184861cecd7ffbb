"""The local-SGD mode's own state: checkpoints, and taking one rank's state (:mod:`distopt.modes.local_sgd`).

Besides the inner optimizer, a local-SGD wrapper holds the step count, the
steps since the last sync, the *anchors* (the parameters at the last sync) and,
for DiLoCo, the outer optimizer over the anchors. The outer optimizer's param
groups come about by history: one at construction, one more for each
``add_param_group`` or parameter unfrozen since. So its layout is saved as
lists of parameter indices (positions in the wrapper's parameter list, the
inner state dict's order), and a load or a broadcast rebuilds the outer
optimizer's groups to that layout before its state goes in: a checkpoint loads
into a wrapper built with the param groups at construction as well as into one
that replays the ``add_param_group`` calls. The outer optimizer is the mode's
own (built by the factory over the anchors), so nobody else holds its groups.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import collectives, stalls

if TYPE_CHECKING:
    from ..optimizer import DistributedOptimizer
    from .local_sgd import LocalSGDMode

__all__ = ["STATE_KEY", "LAYOUT_KEY", "save", "load", "broadcast"]

#: The key under which ``state_dict()`` holds the mode's state, next to the inner optimizer's
#: ``state`` and ``param_groups``: a plain ``torch.optim`` optimizer ignores it when loading.
STATE_KEY = "distopt_local_sgd"

#: Within it: the outer optimizer's param groups, as lists of parameter indices.
LAYOUT_KEY = "outer_groups"

Layout = List[List[int]]


def save(mode: "LocalSGDMode", owner: "DistributedOptimizer") -> Dict[str, Any]:
    """The inner optimizer's state dict, plus the mode's state under :data:`STATE_KEY`."""
    out = dict(owner.optimizer.state_dict())
    out[STATE_KEY] = {
        "steps": owner._steps,
        "since_sync": mode.since_sync,
        "anchors": [mode._anchors.get(id(p)) for p in owner._params],
        "outer": None if mode.outer is None else mode.outer.state_dict(),
        LAYOUT_KEY: outer_layout(mode, owner),
    }
    return out


def load(mode: "LocalSGDMode", owner: "DistributedOptimizer", state_dict: Dict[str, Any]) -> None:
    """Load what :func:`save` returned, or a plain optimizer's state dict (the mode then keeps its state).

    Everything is checked before anything changes, and the inner optimizer (which
    checks its own part) is loaded before the mode's state: a load that raises
    leaves the wrapper as it was.

    Raises:
        ValueError: the state dict was saved by another model or optimizer, with an
            outer optimizer into a wrapper without one, or (saved by an older distopt,
            without the layout) with an outer optimizer whose param groups this wrapper
            cannot rebuild.
    """
    mine = state_dict.get(STATE_KEY)
    if mine is None:  # a plain optimizer's state dict: the mode keeps its own state
        owner.optimizer.load_state_dict(state_dict)
        return
    params = owner._params
    saved = mine["anchors"]
    if len(saved) != len(params):
        raise ValueError(
            f"state_dict[{STATE_KEY!r}] holds last-sync copies of {len(saved)} parameters but this "
            f"optimizer has {len(params)}; load a state dict saved by the same model and optimizer"
        )
    for i, (p, anchor) in enumerate(zip(params, saved)):
        if anchor is not None and tuple(anchor.shape) != tuple(p.shape):
            raise ValueError(
                f"state_dict[{STATE_KEY!r}] holds a last-sync copy of shape {tuple(anchor.shape)} for parameter {i}, "
                f"which has shape {tuple(p.shape)} here; load a state dict saved by the same model and optimizer"
            )
    if mine["outer"] is not None and mode._factory is None:
        raise ValueError(
            "the state dict was saved with an outer_optimizer (DiLoCo) but this DistributedOptimizer has none; "
            "pass the same outer_optimizer= as when it was saved"
        )
    steps, since_sync = int(mine["steps"]), int(mine["since_sync"])
    anchored = mode._needs_anchors(owner)
    layout = _checked_layout(mode, owner, mine) if anchored and mine["outer"] is not None else None
    owner.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != STATE_KEY})
    # Nothing below can fail on the state dict's account.
    owner._steps = steps
    if owner._engine.progress is not None:
        owner._engine.progress.step = steps
    mode.since_sync = since_sync
    if anchored:
        missing = [p for p, anchor in zip(params, saved) if anchor is not None and id(p) not in mode._anchors]
        mode._new_anchors(missing, grouped=layout is None)
        with torch.no_grad():
            for p, anchor in zip(params, saved):
                if anchor is not None:
                    mode._anchors[id(p)].copy_(anchor)
        if layout is not None:
            rest = _rebuild_outer(mode, owner, layout)
            mode.outer.load_state_dict(mine["outer"])
            if rest:  # parameters without a last-sync copy in the checkpoint: the factory's defaults
                mode.outer.add_param_group({"params": rest})
    mode._set_local(owner, owner._steps >= mode.local_warmup)
    mode._count_bytes()


def broadcast(mode: "LocalSGDMode", owner: "DistributedOptimizer", src: int) -> None:
    """Give every rank rank ``src``'s step count, steps since the last sync, anchors and outer optimizer.

    Every rank must call it (at the end of a join block, or in ``broadcast_optimizer_state()``).
    Which parameters have anchors, and the outer optimizer's layout, travel first, so
    ranks whose histories differ (only the root loaded a checkpoint) end up alike.
    """
    if owner.world_size == 1:
        return
    group, progress = owner._group(), owner._engine.progress
    params = owner._params
    is_src = dist.get_rank(group) == src
    meta = [{"steps": owner._steps, "since_sync": mode.since_sync,
             "anchored": [i for i, p in enumerate(params) if id(p) in mode._anchors],
             "layout": outer_layout(mode, owner)} if is_src else None]
    with stalls.inspected(progress, "the broadcast of the local-SGD step count and last-sync layout"):
        collectives.broadcast_object_list(meta, src=src, group=group)
    theirs = meta[0]
    if not is_src:
        _keep_anchors_of(mode, owner, theirs["anchored"])
        if theirs["layout"] is None:
            mode.outer = None  # src has none yet; the factory builds it with the first anchor, as on src
        else:
            rest = _rebuild_outer(mode, owner, theirs["layout"])
            if rest:
                mode.outer.add_param_group({"params": rest})
    anchors = [mode._anchors[id(params[i])] for i in theirs["anchored"]]
    if anchors:
        with torch.no_grad(), stalls.inspected(progress, "the broadcast of the last-sync parameters"):
            collectives.broadcast_parameters(anchors, src=src, group=group)
    if theirs["layout"] is not None:
        with stalls.inspected(progress, "the outer-optimizer state broadcast"):
            collectives.broadcast_optimizer_state(mode.outer, src=src, group=group)
    owner._steps = int(theirs["steps"])
    if progress is not None:
        progress.step = owner._steps
    mode.since_sync = int(theirs["since_sync"])
    mode._set_local(owner, owner._steps >= mode.local_warmup)
    mode._count_bytes()


# ---------------------------------------------------------------------- the outer optimizer's layout


def outer_layout(mode: "LocalSGDMode", owner: "DistributedOptimizer") -> Optional[Layout]:
    """The outer optimizer's param groups as lists of parameter indices; None without an outer optimizer."""
    if mode.outer is None:
        return None
    index = {id(mode._anchors[id(p)]): i for i, p in enumerate(owner._params) if id(p) in mode._anchors}
    return [[index[id(anchor)] for anchor in group["params"]] for group in mode.outer.param_groups]


def _checked_layout(mode: "LocalSGDMode", owner: "DistributedOptimizer", mine: Dict[str, Any]) -> Layout:
    """The layout to rebuild the outer optimizer to before loading ``mine["outer"]``.

    Raises:
        ValueError: it does not fit the saved outer optimizer; or the checkpoint has no layout
            (an older distopt's) and this wrapper's outer groups would not come out as saved.
    """
    sizes = [len(group["params"]) for group in mine["outer"]["param_groups"]]
    layout = mine.get(LAYOUT_KEY)
    if layout is None:
        # Saved before the layout was: the groups come out as the old load made them (the outer's
        # groups now, plus one per parameter given an anchor by the load), and must match the saved ones.
        layout = outer_layout(mode, owner) or []
        layout += [[i] for i, (p, anchor) in enumerate(zip(owner._params, mine["anchors"]))
                   if anchor is not None and id(p) not in mode._anchors]
        if [len(group) for group in layout] != sizes:
            raise ValueError(
                f"state_dict[{STATE_KEY!r}] was saved by an older distopt, without the outer optimizer's layout: "
                f"its outer optimizer has {len(sizes)} param groups of {sizes} tensors, and this wrapper's would "
                f"have {len(layout)} of {[len(group) for group in layout]}; build the wrapper as the run that saved "
                "it was built (the same param groups at construction, then the same add_param_group calls and "
                "unfrozen parameters, in order) before loading it"
            )
        return layout
    flat = [i for group in layout for i in group]
    if ([len(group) for group in layout] != sizes or len(set(flat)) != len(flat)
            or any(not isinstance(i, int) or not 0 <= i < len(owner._params) or mine["anchors"][i] is None
                   for i in flat)):
        raise ValueError(
            f"state_dict[{STATE_KEY!r}][{LAYOUT_KEY!r}] = {layout!r} does not fit its outer optimizer's "
            f"{len(sizes)} param groups of {sizes} tensors over the parameters with a last-sync copy; load a "
            "state dict saved by DistributedOptimizer.state_dict() for the same model"
        )
    return [list(group) for group in layout]


def _rebuild_outer(mode: "LocalSGDMode", owner: "DistributedOptimizer", layout: Layout) -> List[Tensor]:
    """Give the outer optimizer exactly ``layout``'s param groups, without state; return the anchors left out.

    Every parameter in ``layout`` has an anchor already. The groups get the optimizer's defaults, which
    the ``load_state_dict`` that follows replaces with the saved hyperparameters.
    """
    params = owner._params
    groups = [[mode._anchors[id(params[i])] for i in group] for group in layout]
    placed = {i for group in layout for i in group}
    rest = [mode._anchors[id(p)] for i, p in enumerate(params) if id(p) in mode._anchors and i not in placed]
    if mode.outer is None:
        if not groups and not rest:
            return rest
        mode._give_outer([a for group in groups for a in group] + rest)
    outer = mode.outer
    outer.param_groups = []
    outer.state = defaultdict(dict)
    for group in groups:
        outer.add_param_group({"params": group})
    return rest


def _keep_anchors_of(mode: "LocalSGDMode", owner: "DistributedOptimizer", anchored: List[int]) -> None:
    """Hold anchors for exactly the parameters at ``anchored`` (values follow; the outer groups are rebuilt)."""
    params = owner._params
    wanted = {id(params[i]) for i in anchored}
    for key in [key for key in mode._anchors if key not in wanted]:
        del mode._anchors[key]
    mode._new_anchors([params[i] for i in anchored if id(params[i]) not in mode._anchors], grouped=False)
    # Parameters left without an anchor get one when trainable, at the next step, as on every rank.
    mode._untracked = [p for p in params if id(p) not in mode._anchors]
    mode._seen = len(params)
