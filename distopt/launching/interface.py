"""Which network interface gloo and NCCL use when the job spans machines.

gloo finds its own address by resolving the host name. On real clusters that
name often does not resolve, or resolves to the wrong interface, and gloo falls
back to the loopback address, so the other hosts' connections are refused. When
``master_addr`` is not a loopback address and the user has not named an
interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``: part of the transport's
environment contract, which the launcher sets up), :func:`pick_interface` takes
the local interface that routes to ``master_addr`` and says so in one line.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from typing import Optional, Tuple

__all__ = ["route_interface", "owning_interface", "pick_interface", "pick_owning_interface", "is_loopback"]

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def route_interface(master_addr: str) -> Optional[Tuple[str, str]]:
    """``(interface, local address)`` this machine uses to reach ``master_addr``.

    Returns:
        None when ``master_addr`` is a loopback address, or the interface cannot be
        told (not Linux). When ``master_addr`` does not resolve, the machine's only
        non-loopback interface, if it has exactly one.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    except OSError:  # torchrun passes node 0's host name, which may not resolve here
        return _only_interface()
    try:
        if ipaddress.ip_address(sockaddr[0]).is_loopback:
            return None
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # a UDP "connect" sends nothing; it only asks the routing table
            local = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if local in _addresses(name, family):
            return name, local
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (no name is looked up)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def owning_interface(host: str) -> Optional[Tuple[str, str]]:
    """``(interface, address)`` of the local interface that holds ``host``'s address.

    Returns:
        None when ``host`` does not resolve, is a loopback address, or no local interface
        holds its address (a name for another machine, say). A name is taken at its first
        address, and an interface at its primary IPv4 address (and its IPv6 ones): give
        ``GLOO_SOCKET_IFNAME`` for a secondary address.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except OSError:
        return None
    if ipaddress.ip_address(sockaddr[0]).is_loopback:
        return None
    for _, name in socket.if_nameindex():
        if sockaddr[0] in _addresses(name, family):
            return name, sockaddr[0]
    return None


def _only_interface() -> Optional[Tuple[str, str]]:
    """The one interface with a non-loopback IPv4 address, if there is exactly one."""
    found = [(name, address) for _, name in socket.if_nameindex() for address in _addresses(name, socket.AF_INET)
             if not ipaddress.ip_address(address).is_loopback]
    return found[0] if len(found) == 1 else None


def _addresses(name: str, family: int) -> Tuple[str, ...]:
    if family == socket.AF_INET:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            return (socket.inet_ntoa(packed[20:24]),)
        except OSError:
            return ()
    try:  # IPv6: /proc/net/if_inet6 lists "address index prefix scope flags name"
        with open("/proc/net/if_inet6") as table:
            return tuple(str(ipaddress.ip_address(bytes.fromhex(fields[0])))
                         for fields in (line.split() for line in table) if fields[-1] == name)
    except OSError:
        return ()


def pick_interface(master_addr: str, announce: bool = True) -> Optional[str]:
    """Point gloo and NCCL at the interface that routes to ``master_addr``, unless the user chose one.

    Args:
        master_addr: node 0's address.
        announce: print the choice in one line (on one process per machine).

    Returns:
        The interface picked, or None (the user's setting stands, or nothing to pick).
    """
    if any(name in os.environ for name in _VARIABLES):
        return None  # the user's choice always wins
    return _use(route_interface(master_addr), f"the one that routes to master_addr {master_addr}", announce)


def pick_owning_interface(host: str, announce: bool = True) -> Optional[str]:
    """Point gloo and NCCL at the interface that holds ``host``'s address, unless the user chose one.

    For a process that advertises ``host`` to its peers (a fault-tolerant replica): its
    gloo connections must come from that address too, not from the loopback address
    that an unresolvable host name makes gloo fall back to.

    Args:
        host: the name or address this process's peers reach it by.
        announce: print the choice in one line.

    Returns:
        The interface picked, or None (the user's setting stands, or nothing to pick).
    """
    if any(name in os.environ for name in _VARIABLES):
        return None
    return _use(owning_interface(host), f"the one that holds the advertised address {host}", announce)


def _use(found: Optional[Tuple[str, str]], why: str, announce: bool) -> Optional[str]:
    if found is None:
        return None
    name, local = found
    for variable in _VARIABLES:
        os.environ[variable] = name
    if announce:
        print(f"distopt: gloo and NCCL use interface {name} ({local}), {why}; "
              f"set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose another", file=sys.stderr, flush=True)
    return name
