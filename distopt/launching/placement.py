"""Where this process runs: its host and its place on it, as torchrun and :func:`distopt.launch` set them up.

This is the one place outside the launcher's own set-up that reads torchrun's ``env://``
contract, for the default islands of :class:`distopt.Islands` (one island per host).
``distopt.launch`` gives worker ``local`` on node ``node_rank`` the global rank
``node_rank * nprocs + local`` and sets ``RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``;
torchrun also sets ``GROUP_RANK``, the index of its agent (its host).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

__all__ = ["this_process"]


def this_process() -> Optional[Tuple[int, int]]:
    """``(host, local_rank)`` of this process, or None where no launcher set it up.

    ``host`` is torchrun's ``GROUP_RANK`` where it is set, else the global rank of the host's
    first process (``RANK - LOCAL_RANK``: :func:`distopt.launch` numbers a host's processes
    one after the other); every process of one host gets the same number, and no two hosts do.
    """
    rank, local_rank, local_world = (os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if rank is None or local_rank is None or local_world is None:
        return None
    group_rank = os.environ.get("GROUP_RANK")
    host = int(group_rank) if group_rank is not None else int(rank) - int(local_rank)
    return host, int(local_rank)
