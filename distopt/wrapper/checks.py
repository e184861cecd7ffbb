"""Argument and parameter checks of :class:`distopt.DistributedOptimizer`.

Everything that decides whether a wrapper may be built: the arguments' types
and ranges, the names given with ``named_parameters``, which wrapper owns a
parameter, and whether every rank holds the same parameters. Errors name the
argument, the bad value and the fix. A mode's arguments are the mode's own to check
(:mod:`distopt.modes`).
"""
from __future__ import annotations

import numbers
import weakref
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional, Tuple

from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from .. import collectives
from .. import compression as compression_module
from ..collectives.tensors import same_everywhere
from ..planning.drift import ON_DRIFT

__all__ = [
    "REDUCE_OPS",
    "check_arguments",
    "check_drift_arguments",
    "byte_count",
    "seconds",
    "names_by_id",
    "no_dtensors",
    "positions",
    "claim",
    "release",
    "owner",
    "check_agreement",
]

REDUCE_OPS = ("mean", "sum")
# The attribute by which a parameter names the wrapper that reduces its gradient.
_OWNER_ATTR = "_distopt_owner"


def check_arguments(
    optimizer: Any,
    reduce_op: Any,
    pack_threshold: Any,
    bcast_period: Any,
    backward_passes_per_step: Any,
    compression: Any,
    sparse_as_dense: Any,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad constructor argument."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build it first, e.g. DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))"
        )
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op must be 'mean' or 'sum', got {reduce_op!r}")
    if pack_threshold != "auto":
        byte_count(pack_threshold, "pack_threshold", "0 sends each gradient alone, \"auto\" measures the link")
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
    compression_module.resolve(compression)
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")


def check_drift_arguments(check_every: Any, drift_atol: Any, drift_rtol: Any,
                          on_drift: Any) -> Tuple[int, float, float, str]:
    """The drift check's arguments, checked: ``(check_every, drift_atol, drift_rtol, on_drift)``.

    Raises:
        TypeError: ``check_every`` not an int, a tolerance not a number.
        ValueError: a negative or NaN value, or an ``on_drift`` other than ``"raise"``/``"warn"``.
    """
    if isinstance(check_every, bool) or not isinstance(check_every, numbers.Integral):
        raise TypeError(f"check_every must be an int (N > 0: compare the ranks every N steps, 0: never), "
                        f"got {check_every!r}; pass e.g. check_every=100")
    if check_every < 0:
        raise ValueError(f"check_every must be an int >= 0 (N > 0: compare the ranks every N steps, 0: never), "
                         f"got {check_every!r}")
    tolerances = []
    for name, value in (("drift_atol", drift_atol), ("drift_rtol", drift_rtol)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number >= 0, got {value!r}; pass e.g. {name}=1e-6")
        if not value >= 0:  # NaN too
            raise ValueError(f"{name} must be a number >= 0 (0: any difference between the ranks counts), "
                             f"got {value!r}")
        tolerances.append(float(value))
    if on_drift not in ON_DRIFT:
        raise ValueError(f"on_drift must be 'raise' or 'warn', got {on_drift!r}; 'warn' warns and trains on "
                         "(check_every=0 turns the periodic check off)")
    return int(check_every), tolerances[0], tolerances[1], on_drift


def byte_count(value: Any, name: str, hint: str) -> int:
    """``value`` as an int number of bytes >= 0: ints, numpy integers and integral floats (``1e6``).

    Raises:
        ValueError: anything else, naming ``name`` and the value.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer() and value >= 0:
        return int(value)
    raise ValueError(f"{name} must be a number of bytes >= 0, a whole one ({hint}), got {value!r}")


def seconds(value: Any, name: str) -> Optional[float]:
    """``value`` (seconds, a ``timedelta`` or None) as positive float seconds or None.

    Raises:
        TypeError: not a number, a timedelta or None.
        ValueError: not positive.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be seconds (a number), a datetime.timedelta or None, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}; pass None to turn it off")
    return float(value)


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


def no_dtensors(optimizer: Optimizer, names: Dict[int, str], first_group: int = 0) -> None:
    """Refuse DTensor parameters (FSDP2's ``fully_shard``, ``distribute_tensor``), from ``first_group`` on.

    A DTensor parameter holds one shard per rank, and its gradient's collectives go through
    DTensor's dispatch, which has no strategy for the wrapper's broadcasts and all-reduces: the
    first one failed on one rank and left the others blaming a rank that was gone. The check
    is local and every rank holds such parameters alike, so every rank raises it, before any
    collective.

    Raises:
        TypeError: naming the first DTensor parameter and what to do instead.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensor
        return
    for g, group in enumerate(optimizer.param_groups[first_group:], start=first_group):
        for j, p in enumerate(group["params"]):
            if isinstance(p, DTensor):
                name = names.get(id(p), f"param_groups[{g}][{j}]")
                raise TypeError(
                    f"parameter {name!r} is a DTensor (placements {tuple(p.placements)}, e.g. from FSDP2's "
                    "fully_shard or distribute_tensor): DistributedOptimizer does not support FSDP2/DTensor "
                    "parameters yet. Build the wrapper over the plain, unsharded model (shard_state=True shards "
                    "the optimizer state, ZeRO-1), or train the FSDP2 model with its plain torch.optim optimizer, "
                    "without DistributedOptimizer; or, FSDP2 inside each host and distopt between the hosts, shard "
                    "over the island dimension of a 2-D mesh and pass mode=distopt.Islands(islands=mesh) "
                    "(docs/islands.md)"
                )


def positions(optimizer: Optimizer, only: Optional[List[Tensor]]) -> List[Tuple[int, int, Tensor]]:
    """``(group index, index in group, parameter)`` for the optimizer's parameters (those in ``only``)."""
    wanted = None if only is None else {id(p) for p in only}
    return [
        (g, j, p)
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
        if wanted is None or id(p) in wanted
    ]


def claim(param: Tensor, owner: Any) -> Optional[Any]:
    """Make ``owner`` the wrapper that reduces ``param``'s gradient.

    Returns:
        The live wrapper that reduced it until now, if another one; it must stop.
    """
    current = getattr(param, _OWNER_ATTR, None)
    previous = current() if current is not None else None
    setattr(param, _OWNER_ATTR, weakref.ref(owner))
    return previous if previous is not owner else None


def owner(param: Tensor) -> Optional[Any]:
    """The live wrapper that reduces ``param``'s gradient, or None."""
    current = getattr(param, _OWNER_ATTR, None)
    return current() if current is not None else None


def release(param: Tensor, owner: Any) -> None:
    """Undo :func:`claim` if ``owner`` still holds ``param``."""
    current = getattr(param, _OWNER_ATTR, None)
    if current is not None and current() is owner:
        delattr(param, _OWNER_ATTR)


def check_agreement(
    settings: Dict[str, Any], params: List[Tensor], names: List[str], group: Optional[ProcessGroup], root: int
) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks' settings or parameters differ.

    Every rank's ``settings`` (whatever shapes the collectives) and each
    parameter's name, shape, dtype, ``requires_grad`` and contiguity, in order, are compared
    by a digest first (one gather of 32 bytes per rank); only when the digests
    differ are the descriptions themselves gathered, to say what differs.

    Args:
        settings: name -> value of every setting that must match.
        params: the parameters, in the order the wrapper tracks them.
        names: their names (``named_parameters``, or their positions).
        group: the group the wrapper communicates on.
        root: the rank whose parameters are the reference.
    """
    # Contiguity too: it decides whether a large gradient is sent where it lies or through a pack.
    mine = (settings, [(n, tuple(p.shape), str(p.dtype), p.requires_grad, p.is_contiguous())
                       for n, p in zip(names, params)])
    if same_everywhere(repr(mine), group):
        return
    everyone = collectives.all_gather_object(mine, group=group)
    # Every rank's keys, in one order: a mode's own settings are missing where another mode runs.
    keys = list(dict.fromkeys(key for theirs in everyone for key in theirs[0]))
    for key in sorted(keys, key=lambda k: k == "mode"):  # the mode itself last, as a backstop
        values = [theirs[0].get(key) for theirs in everyone]
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"DistributedOptimizer was built with different {key} on different ranks ({detail}); every "
                "rank must pass the same settings, since they decide which collectives run"
            )
    reference = everyone[root][1]
    for rank, (_, theirs) in enumerate(everyone):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a is None or b is None or a[1:3] != b[1:3]:
                what = a[0] if a is not None else b[0]
                raise ValueError(
                    f"the model differs between ranks: parameter {i} ({what!r}) is "
                    f"{_describe(a)} on rank {root} but {_describe(b)} on rank {rank}; build the same model "
                    f"({len(reference)} vs {len(theirs)} parameters) on every rank before wrapping the optimizer"
                )
            if a[0] != b[0] and sorted(e[0] for e in reference) != sorted(e[0] for e in theirs):
                raise ValueError(
                    f"the parameters have different names on different ranks: parameter {i} is {a[0]!r} on rank "
                    f"{root} but {b[0]!r} on rank {rank}; pass the same named_parameters= on every rank (given "
                    "on some ranks only, or with a prefix such as 'module.' from a wrapper on some ranks only)"
                )
            if a[0] != b[0]:
                raise ValueError(
                    f"the parameters are in a different order on different ranks: parameter {i} is {a[0]!r} on "
                    f"rank {root} but {b[0]!r} on rank {rank}; build the model and the optimizer's parameter list "
                    "in the same order on every rank (e.g. sort a dict of modules by key)"
                )
            if a[3] != b[3]:
                raise ValueError(
                    f"parameter {i} ({a[0]!r}) is {_trainable(a)} on rank {root} but {_trainable(b)} on rank "
                    f"{rank}; set requires_grad alike on every rank before wrapping the optimizer"
                )
            if a[4] != b[4]:
                raise ValueError(
                    f"parameter {i} ({a[0]!r}) is {_layout(a)} on rank {root} but {_layout(b)} on rank {rank}; "
                    "convert the model's memory format (e.g. model.to(memory_format=torch.channels_last)) alike "
                    "on every rank before wrapping the optimizer"
                )


_Entry = Tuple[str, Tuple[int, ...], str, bool, bool]


def _describe(entry: Optional[_Entry]) -> str:
    return "missing" if entry is None else f"shape {list(entry[1])} {entry[2]}"


def _trainable(entry: _Entry) -> str:
    return "trainable" if entry[3] else "frozen (requires_grad=False)"


def _layout(entry: _Entry) -> str:
    return "contiguous" if entry[4] else "not contiguous (e.g. channels_last)"
