"""torchft's reconfigurable gloo group, with the connection cut of :mod:`distopt.fault_tolerance.sockets`.

This module imports torchft, and only when :func:`process_group` is called: distopt's
core never does.
"""
from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import Any, List, Optional, Tuple, Union

from . import sockets

__all__ = ["process_group", "register", "group_of", "Members"]

#: What the last ``configure`` said: (quorum id, this replica's rank, world size, members' global ranks).
Members = Tuple[int, int, int, Tuple[int, ...]]

_class: Any = None
_class_lock = threading.Lock()
# manager -> the process group it was built with (torchft keeps it private: ``manager._pg``).
_groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def register(manager: Any, group: Any) -> None:
    """Remember that ``manager`` was built with ``group`` (:func:`distopt.fault_tolerance.manager.make_manager` does)."""
    _groups[manager] = group


def group_of(manager: Any) -> Optional[Any]:
    """The process group ``manager`` was :func:`register`-ed with, or None (a manager built elsewhere).

    distopt then sends its packs straight to the group (one quorum wait per step, not per
    pack), runs a codec's all-to-all and all-gather on it, and cuts its connections when a
    collective fails. A manager built elsewhere is reached through ``manager.allreduce``
    only: compressors that all-reduce work, the others are refused, and survivors of a death
    inside a collective wait out gloo's timeout instead of being freed at once.
    """
    return _groups.get(manager)


def process_group(timeout: Union[float, timedelta] = 10.0) -> Any:
    """A torchft ``ProcessGroupGloo`` that cuts its connections on :meth:`cut`, and reports its members.

    Args:
        timeout: gloo's timeout for one collective, in seconds: how long the survivors wait
            for a replica that is silent but not dead (stopped, or its host unreachable).

    Returns:
        The process group, to pass to ``torchft.Manager(pg, ...)``.
    """
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return _cuttable_class()(timeout=timedelta(seconds=seconds))


def _cuttable_class() -> Any:
    global _class
    with _class_lock:
        if _class is None:
            from torchft.process_group import ProcessGroupGloo  # the user asked for fault tolerance

            class CuttableGloo(ProcessGroupGloo):  # type: ignore[misc,valid-type]
                """torchft's gloo group; :meth:`cut` shuts its connections down (see :mod:`.sockets`)."""

                def __init__(self, timeout: timedelta) -> None:
                    super().__init__(timeout=timeout)
                    self.connections: sockets.Sockets = {}
                    self.members: Optional[Members] = None
                    self.cuts = 0
                    self.store_port: Optional[int] = None

                def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                              quorum_id: Optional[int] = None, group_rank: Optional[int] = None,
                              group_world_size: Optional[int] = None,
                              global_ranks: Optional[List[int]] = None) -> None:
                    self.store_port = _port_of(store_addr)
                    self.connections = {}
                    super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                                      group_world_size, global_ranks)
                    self.members = (-1 if quorum_id is None else int(quorum_id), rank, world_size,
                                    tuple(global_ranks or ()))

                def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
                    before = sockets.open_sockets()
                    pg = super()._create_pg(store, rank, world_size)
                    self.connections = sockets.connections_since(before, self.store_port)
                    return pg

                def cut(self) -> int:
                    """Shut this group's connections down: every peer waiting on this replica fails at once."""
                    self.cuts += 1
                    return sockets.cut(self.connections)

            _class = CuttableGloo
        return _class


def _port_of(store_addr: str) -> Optional[int]:
    """The port of torchft's ``host:port/prefix`` store address, or None."""
    try:
        return int(store_addr.split("/", 1)[0].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
