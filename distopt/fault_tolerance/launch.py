"""``python -m distopt.fault_tolerance.launch``: a lighthouse and one torchrun agent per replica, on one machine.

    RUST_LOG=warn python -m distopt.fault_tolerance.launch --replicas 3 --max-restarts 10 train.py [args...]

One torchrun agent restarts *all* of its workers when one fails, so survivors live on only
with one agent per replica; the lighthouse (torchft's) coordinates them. Each agent runs
``torchrun --standalone --nproc-per-node 1 --max-restarts N`` with ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and ``DISTOPT_FT_HOSTNAME`` set, so that the
script's :func:`distopt.fault_tolerance.manager.make_manager` needs no argument. A worker
that dies is restarted by its agent and heals from a live peer. The launcher exits with the
first non-zero agent's code, or 0; Ctrl-C stops everything.
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

__all__ = ["main", "lighthouse_command", "agent_command"]


def lighthouse_command(port: int, *, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int,
                       quorum_tick_ms: int) -> List[str]:
    """The ``torchft_lighthouse`` command line."""
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return [binary, "--bind", f"[::]:{port}", "--min_replicas", str(min_replicas), "--heartbeat_timeout_ms",
            str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms",
            str(quorum_tick_ms)]


def agent_command(script: str, args: Sequence[str], max_restarts: int) -> List[str]:
    """One replica's torchrun agent (one process, its own rendezvous)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
            "--max-restarts", str(max_restarts), script, *args]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distopt.fault_tolerance.launch",
                                     description="A torchft lighthouse and one torchrun agent per replica.")
    parser.add_argument("--replicas", type=int, required=True, help="replicas to start (one process each)")
    parser.add_argument("--max-restarts", type=int, default=10, help="restarts per replica (torchrun's)")
    parser.add_argument("--min-replicas", type=int, default=1, help="a step commits with at least this many")
    parser.add_argument("--port", type=int, default=0, help="the lighthouse's port (default: a free one)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=300)
    parser.add_argument("--join-timeout-ms", type=int, default=200)
    parser.add_argument("--quorum-tick-ms", type=int, default=10)
    parser.add_argument("--hostname", default="localhost", help="the name replicas advertise (must resolve)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    port = options.port or _free_port()
    lighthouse = subprocess.Popen(lighthouse_command(
        port, min_replicas=options.min_replicas, heartbeat_timeout_ms=options.heartbeat_timeout_ms,
        join_timeout_ms=options.join_timeout_ms, quorum_tick_ms=options.quorum_tick_ms))
    agents: List[subprocess.Popen] = []
    code = 0
    try:
        for replica in range(options.replicas):
            env = dict(os.environ, REPLICA_GROUP_ID=str(replica), NUM_REPLICA_GROUPS=str(options.replicas),
                       TORCHFT_LIGHTHOUSE=f"http://{options.hostname}:{port}", DISTOPT_FT_HOSTNAME=options.hostname)
            env.setdefault("RUST_LOG", "warn")
            agents.append(subprocess.Popen(agent_command(options.script, options.args, options.max_restarts), env=env))
        while any(a.poll() is None for a in agents):
            if lighthouse.poll() is not None:
                print("distopt.fault_tolerance.launch: the lighthouse exited", file=sys.stderr)
                code = 1
                break
            time.sleep(0.1)
        code = code or next((a.returncode for a in agents if a.returncode), 0)
    except KeyboardInterrupt:
        code = 130
    finally:
        for process in agents + [lighthouse]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in agents + [lighthouse]:
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
