"""distopt's launcher, torchrun and a dead link across two real network hosts (``tests/_hosts.py`` builds them)."""
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distopt._testing import run_command

from _hosts import finish, ip, start_on, two_hosts  # noqa: F401  (two_hosts is a fixture)

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "_scripts" / "two_hosts.py"


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("RESULT "):])


def _veth(ns):
    return ip("-n", ns, "-o", "link", "show", "type", "veth").stdout.split(":")[1].strip().split("@")[0]


def test_launch_across_two_hosts_picks_the_routed_interface_unless_the_user_chose_and_trains_identically(two_hosts):
    """Host A's node picks the interface that holds its route; host B's user set GLOO_SOCKET_IFNAME, which wins."""
    (ns_a, host_a, addr_a), (ns_b, host_b, _) = two_hosts
    port = 29613
    chosen = dict(os.environ, GLOO_SOCKET_IFNAME=_veth(ns_b))
    procs = [start_on(ns_a, host_a, SCRIPT, 0, addr_a, port),
             start_on(ns_b, host_b, SCRIPT, 1, addr_a, port, env=chosen)]
    out_a, out_b = finish(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out_a + out_b
    (a,), (b,) = _result(out_a), _result(out_b)
    assert (a["host"], b["host"]) == (host_a, host_b)
    assert a["total"] == b["total"] == 3.0
    assert a["identical"] and b["identical"]
    # Horovod's view of the topology: one rank per host, two hosts
    assert (a["local_size"], a["cross_size"], a["cross_rank"]) == (1, 2, 0)
    assert (b["local_size"], b["cross_size"], b["cross_rank"]) == (1, 2, 1)
    assert "distopt: gloo and NCCL use interface dva" in out_a and f"({addr_a})" in out_a, out_a
    assert "distopt: gloo and NCCL use interface" not in out_b, out_b


def test_nothing_is_picked_for_a_loopback_master_or_when_the_user_chose(monkeypatch):
    from distopt.launching.interface import pick_interface

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert pick_interface("127.0.0.1") is None and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert pick_interface("192.0.2.77") is None and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def _accuracy(out):
    lines = [line for line in out.splitlines() if line.startswith("final test accuracy")]
    assert lines, out
    return lines[-1]


def test_torchrun_with_c10d_rendezvous_across_two_hosts_matches_one_host(two_hosts, tmp_path):
    """One torchrun agent per host, c10d rendezvous, the main job: the same result as on one host."""
    example = ROOT / "examples" / "train_digits.py"
    args = [example, "--epochs", "3"]
    # The one-host run goes on beside the two-host one: most of either is process start-up.
    one_host = ThreadPoolExecutor(1)
    baseline = one_host.submit(run_command, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc-per-node", "2", *map(str, args)], None,
                               dict(os.environ, PYTHONPATH=str(ROOT)), 120)
    (ns_a, host_a, addr_a), (ns_b, host_b, addr_b) = two_hosts
    rdzv = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{addr_a}:29615", "--rdzv-id", "two-hosts"]
    # torchrun itself needs these where host names do not resolve: it advertises node 0's store by
    # name (--local-addr gives the address instead) and asks the resolver whether it is the host.
    procs = [start_on(ns_a, host_a, *rdzv, "--rdzv-conf", "is_host=true", "--local-addr", addr_a, *args),
             start_on(ns_b, host_b, *rdzv, "--rdzv-conf", "is_host=false", "--local-addr", addr_b, *args)]
    try:
        outs = finish(procs)
    finally:
        one_host.shutdown()  # it ends by its own timeout at the latest, its tree killed
    code, out, err = baseline.result()
    assert code == 0, out + err
    assert all(proc.returncode == 0 for proc in procs), outs
    # rank 0 prints the result; its line names the accuracy and that the ranks are bitwise identical
    final = [_accuracy(out) for out in outs if "final test accuracy" in out]
    assert final and "bitwise identical" in final[0], outs
    assert final[0].split(" after")[0] == _accuracy(out + err).split(" after")[0]


def test_a_link_going_down_is_a_clear_error_within_the_collective_timeout(two_hosts, tmp_path):
    (ns_a, host_a, addr_a), (ns_b, host_b, _) = two_hosts
    marker = tmp_path / "training"
    procs = [start_on(ns_a, host_a, SCRIPT, 0, addr_a, 29616, "link", marker),
             start_on(ns_b, host_b, SCRIPT, 1, addr_a, 29616, "link", marker)]
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "training never started"
        ip("-n", ns_b, "link", "set", _veth(ns_b), "down")
        out_a = procs[0].communicate(timeout=120)[0]
    finally:
        finish(procs[1:], timeout=0.1) if procs[0].poll() is not None else finish(procs, timeout=0.1)
    (a,) = _result(out_a)
    # host A's rank names the rank it lost, within the 5 s collective timeout plus a margin
    assert a["error"] and "rank 1" in a["error"], a
    assert "no sign of life" in a["error"] or "stopped answering" in a["error"], a
    assert "busy elsewhere" not in a["error"], a
    assert a["seconds_after_marker"] < 5 + 10, a
