"""Per-rank shards of sharded optimizer state (``opt.sharded_state_dict()``): what one records, merging
a save's shards, and the checks before a shard is loaded.

A shard is the inner optimizer's state dict with the state of the parameters its
rank owned only, plus ``"shard"``: the rank, the world size, and the owner of
every parameter in state-dict order (``"owners"``; older shards lack it).
Ownership follows the parameter list as the param groups were added, so a
wrapper built with a checkpoint's param groups at construction may own them
differently from the run that saved it. A shard loads directly only into the
same rank of a wrapper with the same world size and owners; anything else must
go through :func:`merge_state_dicts`, and is refused with a ``ValueError``
rather than dropping state.

Besides the optimizer state a shard carries what is each rank's own anyway (the
wrapper adds the compressor's residuals and PowerSGD's ``Q``). One merged dict
cannot hold every rank's residuals in one, so it keeps them by rank under
:data:`PER_RANK_KEY`, and :func:`own_part` hands a rank its own when the world
size is the save's.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from torch import Tensor
from torch.optim import Optimizer

__all__ = ["SHARD_KEY", "PER_RANK_KEY", "merge_state_dicts", "shard_of", "check_shard", "whole", "own_part"]

#: The key under which a shard records where it comes from.
SHARD_KEY = "shard"
#: The key under which a merged dict keeps what the shards held besides the optimizer state, by rank:
#: ``{"world_size": W, "ranks": [{key: value}, ...]}`` (rank r's entries at index r).
PER_RANK_KEY = "distopt_per_rank"
_OPTIMIZER_KEYS = ("state", "param_groups", SHARD_KEY)

_FIX = ("merge every rank's shard of that save with distopt.merge_state_dicts([torch.load(f) for f in files]) "
        "and load the full state dict on every rank")


def shard_of(optimizer: Optimizer, rank: int, world_size: int, owners: List[int]) -> Dict[str, Any]:
    """``optimizer``'s state dict as rank ``rank``'s shard (its state holds this rank's parameters only).

    Args:
        optimizer: the inner optimizer.
        rank: this rank; ``world_size``: ranks in the group.
        owners: each parameter's owning rank, in state-dict order (-1: stepped by every rank).
    """
    local = optimizer.state_dict()
    local[SHARD_KEY] = {"rank": rank, "world_size": world_size, "owners": list(owners)}
    return local


def merge_state_dicts(shards: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The full state dict from every rank's ``opt.sharded_state_dict()`` (one per rank, any order).

    Args:
        shards: the per-rank dicts of one save.

    Returns:
        What ``opt.state_dict()`` would have gathered: loads into a plain optimizer, an
        unsharded wrapper or a sharded one at any world size. What the shards carry
        besides the optimizer state, each rank's own (the compressor's residuals and
        PowerSGD's ``Q``), cannot become one rank's: the merged dict keeps it by rank
        under :data:`PER_RANK_KEY`. A wrapper at the save's world size loads its own
        rank's, so a resume is bitwise the uninterrupted run; at another world size no
        rank's residuals fit, so the wrapper warns and error feedback starts over
        (what compression had left out at the save is dropped). A plain optimizer
        ignores the key.

    Raises:
        ValueError: the shards are not one complete save (missing or repeated ranks, or
            shards of different world sizes).

    Example::

        >>> shards = [torch.load(f"ckpt/optim-{r}.pt") for r in range(world_size_at_save)]
        >>> opt.load_state_dict(distopt.merge_state_dicts(shards))
    """
    if not shards:
        raise ValueError("merge_state_dicts() needs the shards of every rank, got none")
    worlds = sorted({shard.get(SHARD_KEY, {}).get("world_size", -1) for shard in shards})
    if len(worlds) > 1:
        raise ValueError(f"merge_state_dicts() needs the shards of one save, got shards saved at world sizes {worlds}")
    world = worlds[0] if worlds[0] != -1 else None
    ranks = sorted(shard.get(SHARD_KEY, {}).get("rank", -1) for shard in shards)
    if world is None or ranks != list(range(world)):
        last = "?" if world is None else world - 1
        raise ValueError(f"merge_state_dicts() needs one shard of each rank 0..{last} of one save (from "
                         f"opt.sharded_state_dict()), got ranks {ranks}")
    state: Dict[int, Any] = {}
    for shard in shards:
        state.update(shard["state"])
    merged = {"state": {k: state[k] for k in sorted(state)}, "param_groups": shards[0]["param_groups"]}
    by_rank = {shard[SHARD_KEY]["rank"]: {k: v for k, v in shard.items() if k not in _OPTIMIZER_KEYS}
               for shard in shards}
    if any(by_rank.values()):
        merged[PER_RANK_KEY] = {"world_size": world, "ranks": [by_rank[r] for r in range(world)]}
    return merged


def own_part(state_dict: Dict[str, Any], rank: int, world_size: int) -> Tuple[Dict[str, Any], Dict[str, Any], bool]:
    """Split a merged dict's per-rank entries off: ``(the rest, rank's own entries, whether any were dropped)``.

    Args:
        state_dict: any state dict (one without :data:`PER_RANK_KEY` comes back as it is, with ``{}``).
        rank, world_size: the loading wrapper's.

    Returns:
        The dict without the key; this rank's entries of a save at the same world size (``{}`` at
        another, where no rank's fit); and True when entries holding tensors were dropped that way.
    """
    kept = state_dict.get(PER_RANK_KEY)
    if kept is None:
        return state_dict, {}, False
    rest = {k: v for k, v in state_dict.items() if k != PER_RANK_KEY}
    ranks = kept.get("ranks", [])
    if kept.get("world_size") == world_size and 0 <= rank < len(ranks):
        return rest, dict(ranks[rank]), False
    return rest, {}, any(_holds_tensors(entries) for entries in ranks)


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def whole(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` without its shard record, for a wrapper that keeps all the state.

    Raises:
        ValueError: it is one rank's shard of a save at world size > 1, which lacks the other ranks' state.
    """
    meta = state_dict.get(SHARD_KEY)
    if meta is None:
        return state_dict
    if meta.get("world_size") != 1:
        raise ValueError(
            f"this is rank {meta.get('rank')}'s shard of a save at world size {meta.get('world_size')} "
            "(opt.sharded_state_dict()): it holds the optimizer state of that rank's parameters only, and this "
            f"optimizer keeps all of it; {_FIX}"
        )
    return {k: v for k, v in state_dict.items() if k != SHARD_KEY}


def check_shard(state_dict: Dict[str, Any], rank: int, world_size: int, owners: List[int],
                names: List[str]) -> None:
    """Check that rank ``rank`` of a sharded wrapper may load the shard ``state_dict`` as it is.

    A shard of a world of one is the whole state and always may. Otherwise it must be this
    rank's, of the same world size, with the same owners (an older shard without owners:
    its state must be of parameters this rank owns).

    Args:
        state_dict: the shard.
        rank, world_size: this wrapper's.
        owners: each parameter's owner here, in state-dict order.
        names: each parameter's name, in the same order.

    Raises:
        ValueError: naming what differs (rank, world size, or the parameters whose owner moved).
    """
    meta = state_dict[SHARD_KEY]
    saved_rank, saved_world = meta.get("rank"), meta.get("world_size")
    if saved_world == 1:
        return
    if saved_world != world_size:
        raise ValueError(
            f"load_state_dict() got rank {saved_rank}'s shard of a save at world size {saved_world}, but this "
            f"optimizer runs at world size {world_size}: a shard holds the state of the parameters its rank "
            f"owned at that world size only; {_FIX}"
        )
    if saved_rank != rank:
        raise ValueError(
            f"load_state_dict() on rank {rank} got rank {saved_rank}'s shard (of a save at world size "
            f"{saved_world}): each rank loads its own shard (e.g. f\"optim-{{rank}}.pt\"), or {_FIX}"
        )
    saved = meta.get("owners")
    if saved is not None and len(saved) != len(owners):
        raise ValueError(
            f"load_state_dict() got a shard saved for {len(saved)} parameters, but this optimizer has "
            f"{len(owners)}; load a shard saved by the same model and optimizer"
        )
    if saved is not None:
        moved = [f"{names[i]} (rank {a} at the save, rank {b} here)"
                 for i, (a, b) in enumerate(zip(saved, owners)) if a != b]
        why = "the parameters' owners differ from the save's"
    else:  # an older shard: only its own state can tell
        moved = [f"{names[i]} (rank {owners[i]} here)" if 0 <= i < len(owners) else f"state index {i} (none here)"
                 for i in sorted(state_dict["state"]) if not 0 <= i < len(owners) or owners[i] not in (rank, -1)]
        why = "the shard holds state of parameters that another rank owns here"
    if moved:
        raise ValueError(
            f"load_state_dict() on rank {rank}: {why}: {', '.join(moved)}. Owners follow the param groups in the "
            "order they were added (a group added by add_param_group after construction is owned differently "
            f"from one given at construction), and loading this shard would drop their state; {_FIX}"
        )
