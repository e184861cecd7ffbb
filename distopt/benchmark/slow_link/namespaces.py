"""Two hosts on one machine: network namespaces joined by a veth pair, each end shaped with tbf.

:class:`ShapedLink` builds them on entry and removes them on exit, whatever happened
in between; deleting a namespace also deletes its end of the veth pair, and with it
the pair. Namespaces are named ``distopt-link-<pid>-a`` / ``-b`` after the process
that built them, so a run killed before it could clean up (``SIGKILL``) is swept away
by the next run (:func:`sweep_stale`).

Building them needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``) and the ``ip`` and
``tc`` commands of iproute2; :func:`check_can_build` says clearly what is missing.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .rates import format_rate
from .shaping import TbfParams, choose_tbf

__all__ = ["LinkUnavailableError", "Host", "ShapedLink", "is_root", "check_can_build", "sweep_stale",
           "list_namespaces", "NAMESPACE_PREFIX", "SUBNET"]

#: Every namespace this module builds starts with it.
NAMESPACE_PREFIX = "distopt-link"
#: The /24 the two ends take .1 and .2 of; private to the namespaces, so it cannot clash with the host's.
SUBNET = "10.231.78"

_STALE = re.compile(rf"^{NAMESPACE_PREFIX}-(\d+)-[ab]$")
_TIMEOUT_S = 30


class LinkUnavailableError(RuntimeError):
    """The shaped link cannot be built here; the message says why and what to do instead."""


@dataclass(frozen=True)
class Host:
    """One end of the link.

    Attributes:
        namespace: the network namespace's name (``ip netns exec <namespace> ...``).
        interface: its end of the veth pair (gloo's ``GLOO_SOCKET_IFNAME``).
        address: its IPv4 address.
    """

    namespace: str
    interface: str
    address: str


def is_root() -> bool:
    """Whether this process runs as root (the namespaces and qdiscs need it)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def check_can_build(command: str = "python -m distopt.benchmark --link RATE") -> None:
    """Raise :class:`LinkUnavailableError` unless this process can build the shaped link.

    Args:
        command: the command the user ran, quoted in the message.

    Raises:
        LinkUnavailableError: not Linux, not root, or ``ip``/``tc`` missing; the message
            says what to do.
    """
    if not sys.platform.startswith("linux"):
        raise LinkUnavailableError(
            f"{command} builds two Linux network namespaces joined by a shaped veth pair; this is {sys.platform}. "
            "Run it on Linux, or run the benchmark without --link.")
    if not is_root():
        raise LinkUnavailableError(
            f"{command} needs root: it builds two network namespaces joined by a veth pair and shapes it with "
            "`tc qdisc ... tbf` (CAP_NET_ADMIN and CAP_SYS_ADMIN). Run it as root, e.g. "
            "`sudo env \"PATH=$PATH\" python -m distopt.benchmark --link 200mbit`, or in a container started with "
            "--cap-add NET_ADMIN --cap-add SYS_ADMIN; without root, run the benchmark without --link.")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailableError(
            f"{command} needs the {' and '.join(f'`{t}`' for t in missing)} command(s) of iproute2 on PATH to build "
            "and shape the link; install iproute2 (e.g. `apt-get install iproute2`), or run the benchmark "
            "without --link.")


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=_TIMEOUT_S)


def list_namespaces() -> List[str]:
    """The names of the machine's network namespaces (``ip netns list``), or [] where it fails."""
    try:
        out = _run(["ip", "netns", "list"], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> List[str]:
    """Delete the namespaces of earlier runs whose process is gone (a run killed before its clean-up).

    Returns:
        The names deleted.
    """
    stale = [name for name in list_namespaces()
             if (m := _STALE.match(name)) is not None and not _alive(int(m.group(1)))]
    for name in stale:
        _run(["ip", "netns", "del", name], check=False)
    return stale


class ShapedLink:
    """Two namespaces joined by a veth pair whose ends are both shaped to ``rate_bps`` (each direction).

    Use it as a context manager: the namespaces exist inside the ``with`` block and are
    deleted on leaving it, also on an exception or Ctrl-C. Processes still running in
    them must be ended first (the caller's job); deleting a namespace does not kill them.

    Args:
        rate_bps: the link rate in bits per second.
        tag: distinguishes the names (default: this process's pid, which
            :func:`sweep_stale` relies on).

    Attributes:
        hosts: ``(a, b)``, the two ends.
        tbf: the qdisc on each end.
    """

    def __init__(self, rate_bps: int, tag: Optional[str] = None) -> None:
        self.rate_bps = rate_bps
        self.tbf: TbfParams = choose_tbf(rate_bps)
        tag = str(os.getpid()) if tag is None else tag
        # Interface names have at most 15 characters: "dl" + the pid (at most 7 digits) + a/b.
        self.hosts: Tuple[Host, Host] = (
            Host(f"{NAMESPACE_PREFIX}-{tag}-a", f"dl{tag}a"[:15], f"{SUBNET}.1"),
            Host(f"{NAMESPACE_PREFIX}-{tag}-b", f"dl{tag}b"[:15], f"{SUBNET}.2"),
        )
        self._made: List[str] = []

    def __enter__(self) -> "ShapedLink":
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        """Build the namespaces, the veth pair, the addresses and the qdiscs.

        Raises:
            LinkUnavailableError: a command failed (a container without the privileges,
                say); whatever was built is removed first.
        """
        a, b = self.hosts
        try:
            for host in self.hosts:
                _run(["ip", "netns", "add", host.namespace])
                self._made.append(host.namespace)
            _run(["ip", "link", "add", a.interface, "type", "veth", "peer", "name", b.interface])
            for host in self.hosts:
                _run(["ip", "link", "set", host.interface, "netns", host.namespace])
                _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface])
                _run(["ip", "-n", host.namespace, "link", "set", host.interface, "up"])
                _run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
                # Each end shapes what it sends: together, both directions.
                _run(["tc", "-n", host.namespace, "qdisc", "add", "dev", host.interface, "root", *self.tbf.tc_args()])
        except subprocess.CalledProcessError as exc:
            self.close()
            raise LinkUnavailableError(
                f"could not build the {format_rate(self.rate_bps)} link: `{' '.join(exc.cmd)}` failed: "
                f"{(exc.stderr or '').strip() or 'no message'}. A container needs --cap-add NET_ADMIN "
                "--cap-add SYS_ADMIN; without them, run the benchmark without --link.") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete the namespaces built (and with them the veth pair); safe to call twice."""
        while self._made:
            _run(["ip", "netns", "del", self._made.pop()], check=False)

    def exec_prefix(self, host: Host) -> List[str]:
        """The command prefix that runs a command inside ``host``'s namespace.

        Args:
            host: one of :attr:`hosts`.

        Returns:
            ``["ip", "netns", "exec", <namespace>]``.
        """
        return ["ip", "netns", "exec", host.namespace]
