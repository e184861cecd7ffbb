"""A torchft ``Manager`` set up for distopt: the cuttable gloo group, short timeouts, one advertised host.

A replica tells its peers three addresses: its manager server's, its replica group's
TCPStore's (the peers' gloo group meets there) and its checkpoint server's (a healer
fetches the live state there). torchft advertises the first by the ``hostname`` it is
given, the second by ``MASTER_ADDR`` (``localhost`` under ``torchrun --standalone``) and
the third by ``socket.gethostname()``. Across hosts all three must be reachable from the
others, so :func:`make_manager` advertises the same host for all three.

This module imports torchft, and only when :func:`make_manager` is called.
"""
from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from ..launching.interface import is_loopback, owning_interface, pick_owning_interface
from .replica_group import process_group, register

__all__ = ["make_manager", "advertised_url", "listening_address", "HEARTBEAT_INTERVAL", "COLLECTIVE_TIMEOUT"]

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
    every argument has a default from the environment. With ``--nproc-per-node K`` each worker's
    manager is rank ``$RANK`` of ``$WORLD_SIZE`` in its replica group (torchft's ``group_rank`` and
    ``group_world_size``; ``rank=`` and ``world_size=`` set them otherwise), on its agent's store:
    rank 0 runs the group's manager server, and the manager's process group joins rank ``j`` of
    every replica (``distopt.Islands``' across group).

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
        store_addr: this replica group's TCPStore host, as the other replicas reach it (default:
            ``$MASTER_ADDR``; where that is a loopback name and ``hostname`` is given,
            ``hostname``: torchrun's store listens on every interface).
        store_port: its port (default: ``$MASTER_PORT``).
        hostname: the name or address peers reach this replica by: its manager server, store and
            checkpoint server are advertised under it (default: ``$DISTOPT_FT_HOSTNAME``, else
            this host's name, which must then resolve on every host). Where it is an address of
            one of this host's interfaces, gloo binds to that interface unless
            ``GLOO_SOCKET_IFNAME`` is set.
        **kwargs: passed on to ``torchft.Manager``.

    Returns:
        The manager. Call ``manager.shutdown()`` before the process exits.
    """
    from torchft import Manager  # the user asked for fault tolerance

    if replica_id is None:
        replica_id = f"replica_{os.environ.get('REPLICA_GROUP_ID', '0')}"
    chosen = hostname or os.environ.get("DISTOPT_FT_HOSTNAME")
    if store_addr is None and chosen and is_loopback(os.environ.get("MASTER_ADDR", "")):
        store_addr = chosen
    if chosen:
        # gloo finds its own address by the host's name; where that does not resolve it falls back
        # to 127.0.0.1, which it then tells the peers on other hosts. Bind it to the advertised address.
        pick_owning_interface(chosen, announce=int(os.environ.get("RANK", "0")) == 0)
    seconds = timedelta(seconds=timeout)
    if "checkpoint_transport" not in kwargs and chosen:
        kwargs["checkpoint_transport"] = _http_transport(chosen, seconds)
    group = process_group(seconds)
    rank = kwargs.pop("rank", int(os.environ.get("RANK", "0")))
    world_size = kwargs.pop("world_size", int(os.environ.get("WORLD_SIZE", "1")))
    if world_size > 1:
        _forget_last_manager(store_addr or os.environ["MASTER_ADDR"],
                             store_port if store_port is not None else int(os.environ["MASTER_PORT"]), rank,
                             timedelta(seconds=connect_timeout))
    manager = Manager(
        pg=group, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        timeout=seconds, quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=connect_timeout), heartbeat_interval=timedelta(seconds=heartbeat_interval),
        replica_id=replica_id, lighthouse_addr=lighthouse, store_addr=store_addr, store_port=store_port,
        hostname=chosen or socket.gethostname(),
        rank=rank, world_size=world_size, **kwargs,
    )
    register(manager, group)
    return manager


def _forget_last_manager(host: str, port: int, rank: int, timeout: timedelta) -> None:
    """Before a replica group of several processes builds its Managers: clear what its last attempt left.

    Rank 0's Manager writes its server's address into the replica group's store, where the other
    ranks' Managers read it; torchrun keeps that store across the restarts of a replica group, so
    without this a restarted rank could read the dead server's address and wait on it. Rank 0
    deletes the keys first, and the other ranks wait for its word of this attempt
    (``TORCHELASTIC_RESTART_COUNT``, torchrun's) before they read.
    """
    from torch.distributed import TCPStore
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    store = TCPStore(host_name=host, port=port, is_master=False, wait_for_workers=False, timeout=timeout)
    cleared = f"distopt/manager_keys_cleared/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
        store.set(cleared, "1")
    else:
        store.wait([cleared])


def advertised_url(url: str, host: str) -> str:
    """``url`` with its host replaced by ``host`` (an IPv6 address gets its brackets), the port kept."""
    parts = urlsplit(url)
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _http_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` instead of ``socket.gethostname()``, and
    listening on ``host``'s interface only (:func:`listening_address`) where this host holds it."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            address = listening_address(host)
            if address is not None:
                _rebind(self, address)

        def address(self) -> str:
            return advertised_url(super().address(), host)

    # num_chunks=0: the whole state in one request, as the Manager's own default transport
    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


def listening_address(host: str) -> Optional[str]:
    """The one address a checkpoint server advertised as ``host`` listens on: the loopback address for
    ``localhost`` or a loopback address, the address of the interface that holds ``host``'s; None (every
    interface, torchft's own choice) where no interface of this host holds it."""
    if is_loopback(host):
        return "127.0.0.1" if host == "localhost" else host
    owned = owning_interface(host)
    return owned[1] if owned is not None else None


def _rebind(transport: Any, address: str) -> None:
    """Move torchft's checkpoint server from every interface (torchft 0.2.0 binds ``("", 0)``) to ``address``.

    The server has served nothing yet: torchft disallows checkpoints until its first quorum.
    """
    from http.server import ThreadingHTTPServer

    server = transport._server
    handler = server.RequestHandlerClass
    server.shutdown()
    server.server_close()
    transport._thread.join()

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        request_queue_size = server.request_queue_size

    transport._server = Server((address, 0), handler)
    transport._thread = threading.Thread(target=transport._serve, daemon=True)
    transport._thread.start()
