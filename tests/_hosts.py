"""Two real network hosts on one box, for the tests that need them (how to build them and start a process on one).

Network namespaces joined by a veth pair, each with its own address and its own host name
(a UTS namespace), and no /etc/hosts entry for either name. :func:`network_hosts` builds them and
removes them afterwards, also when a test fails; where they cannot be built (not root, no
``ip``), it raises :class:`HostsUnavailable`, whose message the tests skip with.
"""
import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator, List, Tuple

from distopt._testing import kill_tree

__all__ = ["network_hosts", "HostsUnavailable", "start_on", "finish", "ip", "SUBNET"]

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.231.77"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


class HostsUnavailable(Exception):
    """Two network hosts cannot be built here; the message says why."""


@contextlib.contextmanager
def network_hosts() -> Iterator[List[Tuple[str, str, str]]]:
    """``[(namespace, host name, address)] * 2``; removed afterwards whatever happens.

    Raises:
        HostsUnavailable: before yielding, where they cannot be built (not root, no ``ip``).
    """
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise HostsUnavailable("needs the `ip` and `unshare` commands to build network namespaces")
    if os.geteuid() != 0:
        raise HostsUnavailable("needs root to build network namespaces")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"distopt-{tag}-a", f"host-a-{tag}", f"{SUBNET}.1"), (f"distopt-{tag}-b", f"host-b-{tag}", f"{SUBNET}.2")]
    veths = (f"dva{tag}", f"dvb{tag}")
    made = []
    try:
        try:
            for ns, _, _ in hosts:
                ip("netns", "add", ns)
                made.append(ns)
            ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
            for (ns, _, address), veth in zip(hosts, veths):
                ip("link", "set", veth, "netns", ns)
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
                ip("-n", ns, "link", "set", veth, "up")
                ip("-n", ns, "link", "set", "lo", "up")
            # each host gets its own name through a UTS namespace: check that one can be made here
            ip("netns", "exec", hosts[0][0], "unshare", "--uts", "true")
        except subprocess.CalledProcessError as exc:  # a container without the privileges, say
            raise HostsUnavailable(f"cannot build network namespaces here ({' '.join(exc.cmd)}: "
                                   f"{exc.stderr.strip()})") from None
        yield hosts
    finally:
        for ns in made:  # deleting a namespace removes its end of the veth pair, and so the pair
            ip("netns", "del", ns, check=False)


def start_on(ns, host, *args, env=None):
    """``python ARGS`` on host ``(ns, host)``, in a session of its own, its output piped (text)."""
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = f"hostname {host} && exec {sys.executable} " + " ".join(str(a) for a in args)
    return subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(procs, timeout=150):
    """Each process's output once it ends; any still running after ``timeout`` s is killed with its tree."""
    outs = []
    try:
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                if timeout > 1:
                    raise
                outs.append("")  # not waited for: killed below
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)  # torchrun's workers run in sessions of their own
                proc.wait()
    return outs
