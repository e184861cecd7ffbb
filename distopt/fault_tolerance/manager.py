"""A torchft ``Manager`` set up for distopt: the cuttable gloo group and short timeouts.

This module imports torchft, and only when :func:`make_manager` is called.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Optional

from .process_group import process_group

__all__ = ["make_manager", "HEARTBEAT_INTERVAL", "COLLECTIVE_TIMEOUT"]

#: Seconds between two heartbeats of a replica to the lighthouse (torchft's default: 0.1).
HEARTBEAT_INTERVAL = 0.05
#: Seconds a collective waits for a silent peer (gloo's timeout on the replicas' group).
COLLECTIVE_TIMEOUT = 10.0


def make_manager(*, min_replicas: int = 1, timeout: float = COLLECTIVE_TIMEOUT, quorum_timeout: float = 120.0,
                 connect_timeout: float = 30.0, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 replica_id: Optional[str] = None, lighthouse: Optional[str] = None,
                 store_addr: Optional[str] = None, store_port: Optional[int] = None,
                 hostname: Optional[str] = None, **kwargs: Any) -> Any:
    """A ``torchft.Manager`` for ``DistributedOptimizer(opt, fault_tolerance=manager)``.

    Under ``python -m distopt.fault_tolerance.launch`` (or torchrun with torchft's variables)
    every argument has a default from the environment.

    Args:
        min_replicas: a step commits only with at least this many replicas.
        timeout: seconds a collective, a commit vote or a heal waits (the group's gloo timeout
            too: how long survivors wait for a peer that is silent but not dead).
        quorum_timeout: seconds a replica waits for a quorum.
        connect_timeout: seconds to connect to the lighthouse and the peers' managers.
        heartbeat_interval: seconds between heartbeats; the lighthouse's
            ``--heartbeat_timeout_ms`` should be several of them.
        replica_id: this replica's id (default: ``replica_$REPLICA_GROUP_ID``); the number at its
            end is its global rank in membership events.
        lighthouse: the lighthouse's address (default: ``$TORCHFT_LIGHTHOUSE``).
        store_addr: this replica group's TCPStore host (default: ``$MASTER_ADDR``).
        store_port: its port (default: ``$MASTER_PORT``).
        hostname: the name peers reach this replica by (default: ``$DISTOPT_FT_HOSTNAME``, else
            this host's name); it must resolve on every host.
        **kwargs: passed on to ``torchft.Manager``.

    Returns:
        The manager. Call ``manager.shutdown()`` before the process exits.
    """
    from torchft import Manager  # the user asked for fault tolerance

    if replica_id is None:
        replica_id = f"replica_{os.environ.get('REPLICA_GROUP_ID', '0')}"
    seconds = timedelta(seconds=timeout)
    return Manager(
        pg=process_group(seconds), load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        timeout=seconds, quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=connect_timeout), heartbeat_interval=timedelta(seconds=heartbeat_interval),
        replica_id=replica_id, lighthouse_addr=lighthouse, store_addr=store_addr, store_port=store_port,
        hostname=hostname or os.environ.get("DISTOPT_FT_HOSTNAME") or socket.gethostname(),
        rank=kwargs.pop("rank", int(os.environ.get("RANK", "0"))),
        world_size=kwargs.pop("world_size", int(os.environ.get("WORLD_SIZE", "1"))), **kwargs,
    )
