"""distopt's launcher, torchrun and a dead link across two real network hosts (``tests/_hosts.py`` builds them).

The three jobs run side by side in one module fixture, as they would on separate machines:
most of each is process start-up and waiting for a timeout. The launch and torchrun share
one pair of hosts (ports of their own); the job whose link goes down has a pair to itself.
"""
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict

import pytest

from distopt._testing import assert_no_children, live_children, run_command

from _hosts import HostsUnavailable, finish, ip, network_hosts, start_on

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "_scripts" / "two_hosts.py"


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("RESULT "):])


def _veth(ns):
    return ip("-n", ns, "-o", "link", "show", "type", "veth").stdout.split(":")[1].strip().split("@")[0]


def _launch_job(hosts) -> Dict[str, Any]:
    """distopt.launch with a node on each host; host B's user chose the interface (GLOO_SOCKET_IFNAME)."""
    (ns_a, host_a, addr_a), (ns_b, host_b, _) = hosts
    port = 29613
    chosen = dict(os.environ, GLOO_SOCKET_IFNAME=_veth(ns_b))
    procs = [start_on(ns_a, host_a, SCRIPT, 0, addr_a, port),
             start_on(ns_b, host_b, SCRIPT, 1, addr_a, port, env=chosen)]
    outs = finish(procs)
    return {"hosts": hosts, "codes": [proc.returncode for proc in procs], "outs": outs}


def _torchrun_job(hosts, tmp: Path) -> Dict[str, Any]:
    """One torchrun agent per host, c10d rendezvous, the main job; beside it the same job on one host."""
    example = ROOT / "examples" / "train_digits.py"
    args = [example, "--epochs", "3"]
    one_host = ThreadPoolExecutor(1)
    baseline = one_host.submit(run_command, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc-per-node", "2", *map(str, args)], tmp,
                               dict(os.environ, PYTHONPATH=str(ROOT)), 120)
    (ns_a, host_a, addr_a), (ns_b, host_b, addr_b) = hosts
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
    return {"codes": [proc.returncode for proc in procs], "outs": outs, "one_host": baseline.result()}


def _link_job(hosts, tmp: Path) -> Dict[str, Any]:
    """Both ranks train until rank 0 writes a marker; then host B's link goes down. Host A's result."""
    (ns_a, host_a, addr_a), (ns_b, host_b, _) = hosts
    marker = tmp / "training"
    procs = [start_on(ns_a, host_a, SCRIPT, 0, addr_a, 29616, "link", marker),
             start_on(ns_b, host_b, SCRIPT, 1, addr_a, 29616, "link", marker)]
    started, out_a = False, ""
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        started = marker.exists()
        if started:
            ip("-n", ns_b, "link", "set", _veth(ns_b), "down")
            out_a = procs[0].communicate(timeout=120)[0]
    finally:
        if started and procs[0].poll() is not None:  # host A's output is read: end host B's node
            finish(procs[1:], timeout=0.1)
        else:
            out_a = finish(procs, timeout=0.1)[0] or out_a
    return {"started": started, "out_a": out_a}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, Any]]:
    """Every job of this module, run side by side: ``name -> what it left``. Skips where hosts cannot be built."""
    before = [proc.pid for proc in live_children()]
    try:
        with network_hosts() as shared, network_hosts() as own:
            with ThreadPoolExecutor(3) as pool:
                futures = {"launch": pool.submit(_launch_job, shared),
                           "torchrun": pool.submit(_torchrun_job, shared, tmp_path_factory.mktemp("torchrun")),
                           "link": pool.submit(_link_job, own, tmp_path_factory.mktemp("link"))}
                results = {name: future.result() for name, future in futures.items()}
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    assert_no_children(ignore=before)  # the tests below see only what the jobs left, so check here
    return results


def test_launch_across_two_hosts_picks_the_routed_interface_unless_the_user_chose_and_trains_identically(jobs):
    """Host A's node picks the interface that holds its route; host B's user set GLOO_SOCKET_IFNAME, which wins."""
    job = jobs["launch"]
    (_, host_a, addr_a), (_, host_b, _) = job["hosts"]
    out_a, out_b = job["outs"]
    assert job["codes"] == [0, 0], out_a + out_b
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


def test_torchrun_with_c10d_rendezvous_across_two_hosts_matches_one_host(jobs):
    """One torchrun agent per host, c10d rendezvous, the main job: the same result as on one host."""
    job = jobs["torchrun"]
    outs = job["outs"]
    code, out, err = job["one_host"]
    assert code == 0, out + err
    assert job["codes"] == [0, 0], outs
    # rank 0 prints the result; its line names the accuracy and that the ranks are bitwise identical
    final = [_accuracy(out) for out in outs if "final test accuracy" in out]
    assert final and "bitwise identical" in final[0], outs
    assert final[0].split(" after")[0] == _accuracy(out + err).split(" after")[0]


def test_a_link_going_down_is_a_clear_error_within_the_collective_timeout(jobs):
    job = jobs["link"]
    out_a = job["out_a"]
    assert job["started"], f"training never started:\n{out_a}"
    (a,) = _result(out_a)
    # host A's rank names the rank it lost, within the 5 s collective timeout plus a margin
    assert a["error"] and "rank 1" in a["error"], a
    assert "no sign of life" in a["error"] or "stopped answering" in a["error"], a
    assert "busy elsewhere" not in a["error"], a
    assert a["seconds_after_marker"] < 5 + 10, a
