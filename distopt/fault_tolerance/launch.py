"""``python -m distopt.fault_tolerance.launch``: a lighthouse and one torchrun agent per replica.

    RUST_LOG=warn python -m distopt.fault_tolerance.launch --replicas 3 --max-restarts 10 train.py [args...]

One torchrun agent restarts *all* of its workers when one fails, so survivors live on only
with one agent per replica; the lighthouse (torchft's) coordinates them. Each agent runs
``torchrun --standalone --nproc-per-node K --max-restarts N`` (``K`` is ``--nproc-per-node``,
default 1: a replica of several processes is an island of :class:`distopt.Islands`, whose
ranks are that agent's workers and heal together) with ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and ``DISTOPT_FT_HOSTNAME`` set, so that the
script's :func:`distopt.fault_tolerance.manager.make_manager` needs no argument. A worker
that dies is restarted by its agent (with the other workers of its replica) and heals from a
live peer.

The lighthouse binds the interface of ``--hostname`` (the loopback one for ``localhost``), not
every interface; torchft's manager and checkpoint servers bind every interface whatever it is
given, so the replicas' network must be private (docs/fault-tolerance.md, "Trust boundary"). The launcher exits with the
first non-zero agent's code, or 0; Ctrl-C stops everything.

**Several hosts.** One host starts the lighthouse and its share of the replicas; the
others start theirs and name that lighthouse. ``--hostname`` is the address the other
hosts reach this one by::

    # host A (10.0.0.1): the lighthouse on port 29510, replicas 0 and 1 of 4
    python -m distopt.fault_tolerance.launch --replicas 4 --replica-ids 0,1 --port 29510 \
        --hostname 10.0.0.1 train.py
    # host B (10.0.0.2): replicas 2 and 3
    python -m distopt.fault_tolerance.launch --replicas 4 --replica-ids 2,3 \
        --lighthouse http://10.0.0.1:29510 --hostname 10.0.0.2 train.py
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence
from urllib.parse import urlsplit

from ..launching.interface import is_loopback, owning_interface

__all__ = ["main", "lighthouse_command", "agent_command", "replica_ids", "bind_address", "processes_per_replica"]


def lighthouse_command(port: int, *, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int,
                       quorum_tick_ms: int, bind: str = "::") -> List[str]:
    """The ``torchft_lighthouse`` command line.

    Args:
        port: the port it listens on.
        min_replicas, heartbeat_timeout_ms, join_timeout_ms, quorum_tick_ms: torchft's flags.
        bind: the address it listens on (default ``"::"``: every interface; see :func:`bind_address`).
    """
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    host = f"[{bind}]" if ":" in bind else bind
    return [binary, "--bind", f"{host}:{port}", "--min_replicas", str(min_replicas), "--heartbeat_timeout_ms",
            str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms",
            str(quorum_tick_ms)]


def agent_command(script: str, args: Sequence[str], max_restarts: int, local_addr: Optional[str] = None,
                  nproc_per_node: int = 1) -> List[str]:
    """One replica's torchrun agent (its own rendezvous and store: one replica group).

    Args:
        script: the training script.
        args: its arguments.
        max_restarts: torchrun's restarts of the workers (all of them, when one fails).
        local_addr: the address torchrun advertises for this node instead of looking up the
            host's name (which need not resolve), and so its workers' ``MASTER_ADDR``
            (default: None, the host's name).
        nproc_per_node: the replica's processes (default 1; more: an island of ``distopt.Islands``).
    """
    where = ["--local-addr", local_addr] if local_addr else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
            str(nproc_per_node), *where, "--max-restarts", str(max_restarts), script, *args]


def bind_address(hostname: str) -> str:
    """Where the lighthouse listens: the loopback address for a loopback ``hostname`` (one host), the
    address of the interface that holds ``hostname``'s, else every interface (``"::"``: a name that
    resolves to no interface of this host, e.g. behind a NAT)."""
    if is_loopback(hostname):
        return "127.0.0.1" if hostname == "localhost" else hostname
    owned = owning_interface(hostname)
    return owned[1] if owned is not None else "::"


def processes_per_replica(value: str) -> int:
    """``--nproc-per-node``: a positive number of processes.

    Raises:
        argparse.ArgumentTypeError: anything else, with the fix.
    """
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"takes the number of processes of each replica, a whole number of at least 1 (1: one process per "
            f"replica; k > 1: islands of k ranks, mode=distopt.Islands(...)), got {value!r}")
    return count


def replica_ids(text: Optional[str], replicas: int) -> List[int]:
    """The replicas this host starts: ``"0,2"`` -> ``[0, 2]``; None -> all of them.

    Raises:
        ValueError: a number is not a replica (``0 <= i < replicas``), or is given twice.
    """
    if text is None:
        return list(range(replicas))
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--replica-ids takes replica numbers separated by commas, e.g. 0,1; got {text!r}") from None
    bad = [i for i in ids if not 0 <= i < replicas]
    if not ids or bad or len(set(ids)) != len(ids):
        raise ValueError(f"--replica-ids must name distinct replicas in 0..{replicas - 1} (--replicas {replicas}); "
                         f"got {text!r}")
    return ids


#: The flags that set up the lighthouse this launcher starts (none with --lighthouse).
_LIGHTHOUSE_FLAGS = ("--port", "--min-replicas", "--heartbeat-timeout-ms", "--join-timeout-ms", "--quorum-tick-ms")


def _is_local_url(url: str) -> bool:
    return is_loopback(urlsplit(url).hostname or "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distopt.fault_tolerance.launch",
                                     description="A torchft lighthouse and one torchrun agent per replica.")
    parser.add_argument("--replicas", type=int, required=True, help="replicas in the job, on all hosts")
    parser.add_argument("--nproc-per-node", type=processes_per_replica, default=1, metavar="K",
                        help="processes per replica (default 1); K > 1: each replica is an island of K ranks "
                             "(mode=distopt.Islands), one torchrun agent of K workers")
    parser.add_argument("--replica-ids", metavar="I,J", help="the replicas this host starts (default: all)")
    parser.add_argument("--lighthouse", metavar="URL",
                        help="a lighthouse another host started (http://HOST:PORT); none is started here")
    parser.add_argument("--max-restarts", type=int, default=10, help="restarts per replica (torchrun's)")
    parser.add_argument("--min-replicas", type=int, default=1, help="a step commits with at least this many")
    parser.add_argument("--port", type=int, default=0, help="the lighthouse's port (default: a free one)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=300)
    parser.add_argument("--join-timeout-ms", type=int, default=200)
    parser.add_argument("--quorum-tick-ms", type=int, default=10)
    parser.add_argument("--hostname", default="localhost",
                        help="the name or address other hosts reach this one by (default: localhost, one host)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    try:
        here = replica_ids(options.replica_ids, options.replicas)
    except ValueError as exc:
        parser.error(str(exc))
    if options.lighthouse is not None:
        ignored = [flag for flag in _LIGHTHOUSE_FLAGS if getattr(options, flag[2:].replace("-", "_"))
                   != parser.get_default(flag[2:].replace("-", "_"))]
        if ignored:
            parser.error(f"{', '.join(ignored)} set(s) up the lighthouse this launcher starts, and with --lighthouse "
                         f"{options.lighthouse} it starts none: give {'them' if len(ignored) > 1 else 'it'} to the "
                         "launcher that starts the lighthouse")
        if options.hostname == "localhost" and not _is_local_url(options.lighthouse):
            parser.error(f"--lighthouse {options.lighthouse} is on another host, whose replicas would be told to reach "
                         "this one at localhost: give --hostname, this host's name or address as the others reach it")
    elif len(here) < options.replicas and options.hostname == "localhost":
        print(f"distopt.fault_tolerance.launch: --replica-ids {options.replica_ids} leaves replicas to other launchers; "
              "if they run on other hosts, give --hostname (this host's name or address as they reach it)",
              file=sys.stderr, flush=True)
    lighthouse: Optional[subprocess.Popen] = None
    address = options.lighthouse
    if address is None:
        port = options.port or _free_port()
        bind = bind_address(options.hostname)
        lighthouse = subprocess.Popen(lighthouse_command(
            port, min_replicas=options.min_replicas, heartbeat_timeout_ms=options.heartbeat_timeout_ms,
            join_timeout_ms=options.join_timeout_ms, quorum_tick_ms=options.quorum_tick_ms, bind=bind))
        # one host: the loopback address it listens on, not a name that may resolve to another (::1)
        reached = bind if is_loopback(options.hostname) else options.hostname
        address = f"http://{'[%s]' % reached if ':' in reached else reached}:{port}"
        print(f"distopt.fault_tolerance.launch: lighthouse at {address}", file=sys.stderr, flush=True)
    agents: List[subprocess.Popen] = []
    code = 0
    try:
        for replica in here:
            env = dict(os.environ, REPLICA_GROUP_ID=str(replica), NUM_REPLICA_GROUPS=str(options.replicas),
                       TORCHFT_LIGHTHOUSE=address, DISTOPT_FT_HOSTNAME=options.hostname)
            env.setdefault("RUST_LOG", "warn")
            local_addr = None if options.hostname == "localhost" else options.hostname
            agents.append(subprocess.Popen(agent_command(options.script, options.args, options.max_restarts, local_addr,
                                                         options.nproc_per_node), env=env))
        while any(a.poll() is None for a in agents):
            if lighthouse is not None and lighthouse.poll() is not None:
                print("distopt.fault_tolerance.launch: the lighthouse exited", file=sys.stderr)
                code = 1
                break
            time.sleep(0.1)
        code = code or next((a.returncode for a in agents if a.returncode), 0)
    except KeyboardInterrupt:
        code = 130
    finally:
        processes = agents + ([lighthouse] if lighthouse is not None else [])
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
