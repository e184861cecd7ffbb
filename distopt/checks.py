"""Argument and parameter checks of :class:`distopt.DistributedOptimizer`.

Everything that decides whether a wrapper may be built: the arguments' types
and ranges, the names given with ``named_parameters``, which wrapper owns a
parameter, and whether every rank holds the same parameters. Errors name the
argument, the bad value and the fix.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from . import collectives

__all__ = [
    "COMPRESSIONS",
    "REDUCE_OPS",
    "check_arguments",
    "names_by_id",
    "positions",
    "claim",
    "release",
    "check_same_params_on_all_ranks",
]

REDUCE_OPS = ("mean", "sum")
#: ``compression=`` values and the dtype each puts on the wire.
COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# The attribute by which a parameter names the wrapper that reduces its gradient.
_OWNER_ATTR = "_distopt_owner"


def check_arguments(
    optimizer: Any,
    reduce_op: Any,
    pack_threshold: Any,
    bcast_period: Any,
    backward_passes_per_step: Any,
    compression: Any,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad constructor argument."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build it first, e.g. DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))"
        )
    if reduce_op not in REDUCE_OPS:
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
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")


def names_by_id(named_parameters: Optional[Iterable[Tuple[str, Tensor]]], optimizer: Optimizer) -> Dict[int, str]:
    """Map ``id(parameter)`` to its name; empty without ``named_parameters``.

    Raises:
        ValueError: a pair is malformed, a name or a parameter appears twice, or
            a parameter of the optimizer has no name.
    """
    if named_parameters is None:
        return {}
    names: Dict[int, str] = {}
    seen_names = set()
    for pair in list(named_parameters):
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
    unnamed = [f"param_groups[{g}][{j}]" for g, j, p in positions(optimizer, None) if id(p) not in names]
    if unnamed:
        raise ValueError(
            f"named_parameters was given, but {len(unnamed)} of the optimizer's parameters have no name "
            f"(first: {unnamed[0]}); pass the model's named_parameters() for every parameter the optimizer holds"
        )
    return names


def positions(optimizer: Optimizer, only: Optional[List[Tensor]]) -> List[Tuple[int, int, Tensor]]:
    """``(group index, index in group, parameter)`` for the optimizer's parameters (those in ``only``)."""
    wanted = None if only is None else {id(p) for p in only}
    return [
        (g, j, p)
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
        if wanted is None or id(p) in wanted
    ]


def claim(param: Tensor, name: str, owner: Any) -> None:
    """Mark ``owner`` as the wrapper that reduces ``param``'s gradient.

    Raises:
        ValueError: another live wrapper already reduces it.
    """
    current = getattr(param, _OWNER_ATTR, None)
    if current is not None and current() is not None and current() is not owner:
        raise ValueError(
            f"parameter {name!r} already belongs to another DistributedOptimizer; give each wrapper its own "
            "parameters, or call close() on the old wrapper first"
        )
    setattr(param, _OWNER_ATTR, weakref.ref(owner))


def release(param: Tensor, owner: Any) -> None:
    """Undo :func:`claim` if ``owner`` still holds ``param``."""
    current = getattr(param, _OWNER_ATTR, None)
    if current is not None and current() is owner:
        delattr(param, _OWNER_ATTR)


def check_same_params_on_all_ranks(
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
