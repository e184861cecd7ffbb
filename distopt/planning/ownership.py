"""Which rank owns which parameter when optimizer state is sharded: pure, and the same on every rank.

Each parameter is owned by exactly one rank and stays a whole tensor. Owners are
chosen greedily, largest parameter first, each going to the rank with the fewest
bytes so far (ties to the lower rank, then to the earlier parameter), which keeps
every rank's share within ``total / world + largest parameter``. Parameters added
later (``add_param_group``) continue from the loads so far, so earlier owners
never move and no state has to travel.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

__all__ = ["assign_owners"]


def assign_owners(nbytes: Sequence[int], world_size: int,
                  loads: Optional[Sequence[int]] = None) -> Tuple[List[int], List[int]]:
    """Owners for parameters of ``nbytes`` bytes each, over ``world_size`` ranks.

    Args:
        nbytes: each parameter's size in bytes, in the wrapper's tracking order.
        world_size: ranks to spread them over (at least 1).
        loads: bytes each rank owns already (default: none).

    Returns:
        ``(owners, loads)``: the owning rank of each parameter, and every rank's bytes after.

    Raises:
        ValueError: ``world_size`` below 1, a negative size, or ``loads`` of the wrong length.

    Example::

        >>> assign_owners([40, 10, 30, 20], 2)
        ([0, 0, 1, 1], [50, 50])
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if any(n < 0 for n in nbytes):
        raise ValueError(f"parameter sizes must be >= 0 bytes, got {list(nbytes)}")
    current = [0] * world_size if loads is None else list(loads)
    if len(current) != world_size:
        raise ValueError(f"loads has {len(current)} entries for world_size={world_size}")
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(world_size), key=lambda r: (current[r], r))
        owners[index] = rank
        current[rank] += nbytes[index]
    return owners, current
