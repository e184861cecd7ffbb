"""Two real network hosts on one box: network namespaces joined by a veth pair, each with its own
address and its own host name (a UTS namespace), and no /etc/hosts entry for either name.

The fixture builds them and removes them afterwards, also when a test fails; where they
cannot be built (not root, no ``ip``), the tests skip and say why.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distopt._testing import kill_tree, run_command

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "_scripts" / "two_hosts.py"
SUBNET = "10.231.77"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """``[(namespace, host name, address)] * 2``; removed afterwards whatever happens."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs the `ip` and `unshare` commands to build network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root to build network namespaces")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"distopt-{tag}-a", f"host-a-{tag}", f"{SUBNET}.1"), (f"distopt-{tag}-b", f"host-b-{tag}", f"{SUBNET}.2")]
    veths = (f"dva{tag}", f"dvb{tag}")
    made = []
    try:
        try:
            for ns, _, _ in hosts:
                _ip("netns", "add", ns)
                made.append(ns)
            _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
            for (ns, _, address), veth in zip(hosts, veths):
                _ip("link", "set", veth, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
                _ip("-n", ns, "link", "set", veth, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            # each host gets its own name through a UTS namespace: check that one can be made here
            _ip("netns", "exec", hosts[0][0], "unshare", "--uts", "true")
        except subprocess.CalledProcessError as exc:  # a container without the privileges, say
            pytest.skip(f"cannot build network namespaces here ({' '.join(exc.cmd)}: {exc.stderr.strip()})")
        yield hosts
    finally:
        for ns in made:  # deleting a namespace removes its end of the veth pair, and so the pair
            _ip("netns", "del", ns, check=False)


def _start(ns, host, *args, env=None):
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = f"hostname {host} && exec {sys.executable} " + " ".join(str(a) for a in args)
    return subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(procs, timeout=150):
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


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("RESULT "):])


def test_launch_across_two_hosts_picks_the_routed_interface_and_trains_identically(two_hosts):
    (ns_a, host_a, addr_a), (ns_b, host_b, _) = two_hosts
    port = 29613
    procs = [_start(ns_a, host_a, SCRIPT, 0, addr_a, port), _start(ns_b, host_b, SCRIPT, 1, addr_a, port)]
    out_a, out_b = _finish(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out_a + out_b
    (a,), (b,) = _result(out_a), _result(out_b)
    assert (a["host"], b["host"]) == (host_a, host_b)
    assert a["total"] == b["total"] == 3.0
    assert a["identical"] and b["identical"]
    # Horovod's view of the topology: one rank per host, two hosts
    assert (a["local_size"], a["cross_size"], a["cross_rank"]) == (1, 2, 0)
    assert (b["local_size"], b["cross_size"], b["cross_rank"]) == (1, 2, 1)
    assert "distopt: gloo and NCCL use interface dva" in out_a and f"({addr_a})" in out_a, out_a
    assert "distopt: gloo and NCCL use interface dvb" in out_b, out_b


def test_the_users_interface_setting_wins(two_hosts):
    (ns_a, host_a, addr_a), (ns_b, host_b, _) = two_hosts
    procs = []
    for (ns, host, _), node in zip(two_hosts, (0, 1)):
        veth = _ip("-n", ns, "-o", "link", "show", "type", "veth").stdout.split(":")[1].strip().split("@")[0]
        procs.append(_start(ns, host, SCRIPT, node, addr_a, 29614, env=dict(os.environ, GLOO_SOCKET_IFNAME=veth)))
    outs = _finish(procs)
    assert all(proc.returncode == 0 for proc in procs), outs
    assert not any("distopt: gloo and NCCL use interface" in out for out in outs), outs


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
    procs = [_start(ns_a, host_a, *rdzv, "--rdzv-conf", "is_host=true", "--local-addr", addr_a, *args),
             _start(ns_b, host_b, *rdzv, "--rdzv-conf", "is_host=false", "--local-addr", addr_b, *args)]
    try:
        outs = _finish(procs)
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
    procs = [_start(ns_a, host_a, SCRIPT, 0, addr_a, 29616, "link", marker),
             _start(ns_b, host_b, SCRIPT, 1, addr_a, 29616, "link", marker)]
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "training never started"
        veth = _ip("-n", ns_b, "-o", "link", "show", "type", "veth").stdout.split(":")[1].strip().split("@")[0]
        _ip("-n", ns_b, "link", "set", veth, "down")
        out_a = procs[0].communicate(timeout=120)[0]
    finally:
        _finish(procs[1:], timeout=0.1) if procs[0].poll() is not None else _finish(procs, timeout=0.1)
    (a,) = _result(out_a)
    # host A's rank names the rank it lost, within the 5 s collective timeout plus a margin
    assert a["error"] and "rank 1" in a["error"], a
    assert "no sign of life" in a["error"] or "stopped answering" in a["error"], a
    assert "busy elsewhere" not in a["error"], a
    assert a["seconds_after_marker"] < 5 + 10, a
