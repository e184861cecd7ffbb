"""Taking parameters on: claim them, check them across ranks, broadcast them, hook them.

A :class:`distopt.DistributedOptimizer` takes on the parameters of its inner
optimizer at construction and again after ``add_param_group``. Each parameter
is reduced by one wrapper only, the newest built over it, so an older wrapper
whose parameters are claimed is retired for good.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import torch
from torch import Tensor

from . import checks, collectives, stalls

if TYPE_CHECKING:  # the front imports this module
    from .optimizer import DistributedOptimizer

__all__ = ["settings", "track_new_params"]


#: The local-SGD arguments as a wrapper in another mode has them (sync_every=1 without an outer
#: optimizer is synchronous training), so that two ranks in different modes differ in an argument.
_NOT_LOCAL = {"sync_every": 1, "local_warmup": 0, "outer_optimizer": False}


def settings(opt: "DistributedOptimizer") -> Dict[str, Any]:
    """Every setting that decides which collectives run; they must match on every rank.

    They are the user's arguments, whatever the mode, so that an error about ranks that
    differ names an argument; the mode itself comes last, as a backstop.
    """
    return {
        "reduce_op": opt.reduce_op,
        "pack_threshold": opt.pack_threshold,
        "compression": opt.compression,
        "bcast_period": opt.bcast_period,
        "backward_passes_per_step": opt.backward_passes_per_step,
        "sparse_as_dense": opt.sparse_as_dense,
        "root_rank": opt.root_rank,
        "shard_state": opt.shard_state,
        **_NOT_LOCAL,
        **opt._mode.settings(),
        "mode": type(opt._mode).__name__,
    }


def _new_params(opt: "DistributedOptimizer") -> List[Tensor]:
    """The inner optimizer's parameters ``opt`` does not hold yet, in param-group order."""
    known = {id(p) for p in opt._params}
    new: List[Tensor] = []
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in known:
                known.add(id(p))
                new.append(p)
    return new


def track_new_params(opt: "DistributedOptimizer") -> None:
    """Take on the parameters ``opt`` does not hold yet: check them across ranks, broadcast them,
    reduce their gradients.

    Frozen parameters are broadcast too, and reduced once they become trainable.

    Raises:
        ValueError: the ranks built different optimizers (settings or parameters).
        StallError: a rank did not arrive at the check or the broadcast in time.
    """
    new = _new_params(opt)
    names = [opt._names_by_id.get(id(p), f"param_groups[{g}][{j}]")
             for g, j, p in checks.positions(opt.optimizer, new)]
    for p in new:
        previous = checks.claim(p, opt)
        if previous is not None:
            previous._retire()
    opt._params.extend(new)
    engine = opt._engine
    if opt.world_size == 1 or not new:
        engine.reset_round()
        return
    with stalls.inspected(engine.progress, "the check that every rank built the same optimizer"):
        checks.check_agreement(settings(opt), new, names, opt._group(), opt.root_rank)
    if opt.bcast_period != -1:
        with torch.no_grad(), stalls.inspected(engine.progress, "the broadcast of the initial parameters"):
            collectives.broadcast_parameters(new, src=opt.root_rank, group=opt._group())
    engine.track(new, names)
    opt._mode.on_track(opt, new)
