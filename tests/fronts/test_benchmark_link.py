"""The slow-link benchmark (``python -m distopt.benchmark --link RATE``): its pure parts, its refusals,
its abort handling on loopback, and, as root, the shaped namespaces themselves.

The full benchmark is not run here (it takes minutes); docs/benchmark.md#slow-links says how.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from distopt.benchmark import main
from distopt.benchmark.slow_link import namespaces, plot
from distopt.benchmark.slow_link.child import Job
from distopt.benchmark.slow_link.config import LinkConfig
from distopt.benchmark.slow_link.contenders import CONTENDERS, DISTOPT_SPECS, ContenderOptions
from distopt.benchmark.slow_link.host import telling_line
from distopt.benchmark.slow_link.namespaces import Host, ShapedLink
from distopt.benchmark.slow_link.rates import format_rate, parse_rate, rate_slug
from distopt.benchmark.slow_link.report import format_link_report, link_report_to_json
from distopt.benchmark.slow_link.results import ContenderRun, TaskResult, choose_target, merge_ranks, smoothed
from distopt.benchmark.slow_link.runner import failure_of
from distopt.benchmark.slow_link.shaping import choose_tbf
from distopt.benchmark.slow_link.supervisor import Supervisor
from distopt.benchmark.slow_link.text import StdlibText, read_stdlib_text, stdlib_sources

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

PROBE = Path(__file__).resolve().parents[2] / "distopt" / "benchmark" / "slow_link" / "probe.py"


# --- rates and tbf -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, bps", [("200mbit", 200 * 10**6), ("1gbit", 10**9), ("1.5Gbit", 15 * 10**8),
                                       ("500kbit", 5 * 10**5), (" 100Mbit/s ", 10**8)])
def test_parse_rate(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text, message", [
    ("200", "--link='200' is not a link rate; write a number and one of kbit, mbit or gbit"),
    ("200mbps", "is not a link rate"),  # tc's mbps is megabytes: refused rather than guessed
    ("fast", "is not a link rate"),
    ("50kbit", "--link='50kbit' is 50 kbit/s; choose a rate from 100 kbit/s to 100 Gbit/s"),
    ("200gbit", "choose a rate from"),
])
def test_parse_rate_refuses_with_the_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rate(text)


def test_format_rate_and_slug() -> None:
    assert [format_rate(r) for r in (2 * 10**8, 15 * 10**8, 5 * 10**5, 10**9)] == [
        "200 Mbit/s", "1.5 Gbit/s", "500 kbit/s", "1 Gbit/s"]
    assert [rate_slug(r) for r in (2 * 10**8, 15 * 10**8, 10**9, 5 * 10**5)] == [
        "200mbit", "1500mbit", "1gbit", "500kbit"]


def test_tbf_burst_is_one_timer_tick_of_the_rate_and_at_least_16_kib() -> None:
    tbf = choose_tbf(200 * 10**6)
    assert (tbf.burst_bytes, tbf.latency_ms) == (100_000, 20)  # 25 MB/s x 4 ms
    assert tbf.tc_args() == ["tbf", "rate", "200000000bit", "burst", "100000", "latency", "20ms"]
    assert choose_tbf(10**9).burst_bytes == 500_000
    assert choose_tbf(10 * 10**6).burst_bytes == 16 * 2**10
    with pytest.raises(ValueError, match="rate_bps=0 must be a positive"):
        choose_tbf(0)


# --- the real task's data ----------------------------------------------------------------------------

def test_stdlib_text_is_deterministic_and_sharded() -> None:
    a, b = StdlibText(200_000), StdlibText(200_000)
    assert a.digest == b.digest and len(a.train) + len(a.val) == 200_000
    assert int(a.train.max()) <= 127
    x1, y1 = a.batch(rank=0, world=2, step=5, batch=4, context=16, seed=0)
    x2, y2 = b.batch(rank=0, world=2, step=5, batch=4, context=16, seed=0)
    assert x1.equal(x2) and y1.equal(y2) and x1.shape == (4, 16)
    assert x1[:, 1:].equal(y1[:, :-1])  # targets are the next bytes
    assert not x1.equal(a.batch(rank=1, world=2, step=5, batch=4, context=16, seed=0)[0])
    assert not x1.equal(a.batch(rank=0, world=2, step=6, batch=4, context=16, seed=0)[0])
    s0, s1 = a.shard(0, 2), a.shard(1, 2)
    assert len(s0) == len(s1) == len(a.train) // 2
    val = a.val_batches(2, 3, 16)
    assert len(val) == 2 and val[0][0].shape == (3, 16)
    with pytest.raises(ValueError, match="rank=2 must be in range"):
        a.shard(2, 2)


def test_stdlib_sources_are_sorted_skip_tests_and_map_non_ascii(tmp_path: Path) -> None:
    for rel, text in (("b.py", "b = 1\n"), ("a/z.py", "z = 'é'\n"), ("test/t.py", "skip\n"), ("a/y.txt", "no\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_sources(tmp_path)] == ["a/z.py", "b.py"]
    text = read_stdlib_text(12, tmp_path)
    assert text == b"z = '\x7f\x7f'\n\nb "  # the two bytes of the e-acute become 127 each; cut at 12
    with pytest.raises(ValueError, match="size=999 is more than the"):
        read_stdlib_text(999, tmp_path)


# --- figures, the target loss and the report ---------------------------------------------------------------

def test_smoothed_is_a_trailing_mean() -> None:
    assert smoothed([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    with pytest.raises(ValueError, match="window=0"):
        smoothed([1.0], 0)


def test_merge_ranks_takes_the_slowest_rank_and_the_mean_loss() -> None:
    merged = merge_ranks([[(0.1, 2.0, 100, None)], [(0.3, 4.0, 300, None)]])
    assert merged == [(300.0, 3.0, 200.0, None)]
    with pytest.raises(ValueError, match="the ranks recorded"):
        merge_ranks([[(0.1, 2.0, 100, None)], []])


def _run(name: str, losses: List[float], ms: float = 100.0, **kwargs: Any) -> ContenderRun:
    run = ContenderRun(name, **kwargs)
    run.add([(ms, loss, 2**20, None) for loss in losses])
    return run


def test_the_target_is_the_references_smoothed_loss_at_80_percent() -> None:
    losses = [10.0 - i for i in range(10)]  # 10, 9, ..., 1
    runs = {"local": _run("local", [x + 1 for x in losses]), "ddp": _run("ddp", losses),
            "fast": _run("fast", [x - 2 for x in losses], ms=50.0)}
    target = choose_target(runs, steps=10)
    # step 8 of 10; window max(3, 10 // 20) = 3: the mean of steps 6-8 (5, 4, 3)
    assert (target.reference, target.step, target.window, target.loss) == ("ddp", 8, 3, 4.0)
    assert target.steps_to(runs["ddp"]) == 8 and target.steps_to(runs["fast"]) == 6
    assert target.seconds_to(runs["fast"]) == pytest.approx(0.3)
    assert target.steps_to(_run("never", [9.0] * 10)) is None
    assert "ddp's training loss at step 8 of 10 (80%)" in target.describe()
    # DDP aborted: distopt stands in, and the report says so
    runs["ddp"].fail("aborted", "rank 0: killed by SIGABRT")
    runs["distopt"] = _run("distopt", losses)
    assert choose_target(runs, steps=10).reference == "distopt"
    assert choose_target({"ddp": _run("ddp", losses[:5])}, steps=10) is None  # did not finish


def _report(tasks: List[TaskResult]) -> Dict[str, Any]:
    probe = {"mbit_s": 191.9, "bytes": 2.0**20, "rtt_ms": 0.05}
    return {
        "config": {"rate_bps": 2 * 10**8, "tasks": [t.name for t in tasks], "contenders": [], "powersgd_rank": 4,
                   "quick": True, "seed": 0},
        "environment": {"torch": "x", "python": "3", "kernel": "k", "cpu": "cpu", "cores": [0, 1],
                        "load_before": (1.0, 1.0, 1.0), "load_after": (2.0, 2.0, 2.0), "seconds": 60.0},
        "link": {"rate_bps": 2 * 10**8, "tbf_text": choose_tbf(2 * 10**8).describe(), "probe_bytes": 2**20,
                 "probe": {"a_to_b": probe, "b_to_a": probe}},
        "tasks": tasks,
    }


def _tasks() -> List[TaskResult]:
    losses = [5.0 - 0.1 * i for i in range(20)]
    schedule = {"warmup": 0, "rounds": 2, "chunk": 10, "eval_every": 2, "steps": 20}
    real = {"local": _run("local", losses, ms=50.0), "ddp": _run("ddp", losses, ms=200.0),
            "ddp-powersgd": ContenderRun("ddp-powersgd", baseline="ddp"),
            "distopt-int8": _run("distopt-int8", [x + 0.01 for x in losses], ms=80.0, baseline="ddp")}
    real["ddp-powersgd"].fail("aborted", "in steps 1-10: rank 1: killed by SIGABRT: collective mismatch")
    for run in real.values():
        if run.ok:
            run.evals.append((20, run.losses[-1] + 0.1))
    steps = {"local": _run("local", [1.0] * 3, ms=20.0), "ddp": _run("ddp", [1.0] * 3, ms=500.0),
             "distopt-int9": ContenderRun("distopt-int9")}
    steps["distopt-int9"].fail("unavailable", "rank 0: ValueError: compression must be None, ...")
    return [TaskResult("mlp", "an mlp", False, {**schedule, "warmup": 2, "eval_every": 0}, steps),
            TaskResult("charlm", "a char LM", True, schedule, real, choose_target(real, 20))]


def test_the_report_gives_each_tasks_figures_and_says_why_a_contender_did_not_finish() -> None:
    text = format_link_report(_report(_tasks()))
    assert "200 Mbit/s each way between two network namespaces" in text
    assert "a->b 191.9, b->a 191.9 Mbit/s of payload (the ceiling is 191.3" in text
    mlp = text[text.index("[mlp]"):text.index("[charlm]")]
    assert "2 warm-up steps, then 2 rounds of 10 steps" in mlp
    assert "25.00" in mlp  # ddp's 500 ms against local's 20 ms
    assert "unavailable [1]" in mlp and "[1] distopt-int9 unavailable: rank 0: ValueError" in mlp
    charlm = text[text.index("[charlm]"):]
    # step 16 of 20, smoothed over 3 steps: the mean of 3.7, 3.6 and 3.5
    assert "target loss 3.6000 = ddp's training loss at step 16 of 20 (80%)" in charlm
    ddp_line = next(line for line in charlm.splitlines() if line.strip().startswith("ddp "))
    # ms, x local, MiB, steps to, s to, x floor
    assert ddp_line.split()[1:7] == ["200.0", "4.00", "1.00", "16", "3.2", "4.00"]
    int8 = next(line for line in charlm.splitlines() if line.strip().startswith("distopt-int8"))
    assert "+0.31%" in int8  # its val loss, 3.21, against its baseline ddp's, 3.2
    assert "aborted [1]" in charlm and "killed by SIGABRT: collective mismatch" in charlm
    data = json.loads(json.dumps(link_report_to_json(_report(_tasks()))))
    assert data["tasks"][1]["target"]["reference"] == "ddp"
    assert data["tasks"][1]["runs"]["ddp-powersgd"]["status"] == "aborted"


def test_the_paired_ratio_cancels_a_host_that_drifts_from_round_to_round() -> None:
    # Round 1 on a fast host, round 2 at twice the step time, round 3 back: the contender costs 10% throughout.
    local = ContenderRun("local")
    stream = ContenderRun("stream")
    for speed in (1.0, 2.0, 1.0):
        local.add([(20.0 * speed, 1.0, 0.0, None)] * 4)
        stream.add([(22.0 * speed, 1.0, 0.0, None)] * 4)
    task = TaskResult("mlp", "an mlp", False, {"warmup": 0, "rounds": 3, "chunk": 4, "eval_every": 0, "steps": 12},
                      {"local": local, "stream": stream})
    assert task.paired_ratio("stream") == pytest.approx(1.1)
    assert task.paired_ratio("local") == pytest.approx(1.0)
    assert TaskResult("mlp", "", False, {"chunk": 4}, {"stream": stream}).paired_ratio("stream") is None
    assert "1.10" in format_link_report(_report([task]))


def test_plots_are_written_per_task(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = plot.write_link_plots(_report(_tasks()), str(tmp_path / "plots"))
    assert [Path(p).name for p in written] == [
        "link-200mbit-mlp-loss.png", "link-200mbit-mlp-bytes.png",
        "link-200mbit-charlm-loss.png", "link-200mbit-charlm-bytes.png"]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_a_missing_matplotlib_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="--plots needs matplotlib, which is not installed: `pip install"):
        plot.require_matplotlib()


# --- contenders and failures -----------------------------------------------------------------------------

def test_every_distopt_row_is_a_contender_with_its_arguments() -> None:
    assert all(spec.name in CONTENDERS for spec in DISTOPT_SPECS)
    specs = {spec.name: spec for spec in DISTOPT_SPECS}
    options = ContenderOptions(powersgd_rank=2)
    assert specs["distopt"].kwargs(options) == {"pack_threshold": "auto"}
    assert specs["distopt-local4-int8"].kwargs(options) == {"pack_threshold": "auto", "compression": "int8",
                                                            "sync_every": 4}
    powersgd = specs["distopt-powersgd"].kwargs(options)["compression"]
    assert (powersgd.rank, powersgd.start_step) == (2, 2)  # DDP's hook starts at iteration 2 too
    assert "outer_optimizer" in specs["diloco4"].kwargs(options)
    assert CONTENDERS["distopt-int8"].baseline == "distopt"
    with pytest.raises(ValueError, match="--powersgd-rank=0 must be an integer of at least 1"):
        ContenderOptions(powersgd_rank=0)


def test_the_reason_is_the_first_real_failure_not_the_peer_the_supervisor_killed() -> None:
    abort = ("gone", -int(signal.SIGABRT), "what(): ... Is there a distributed collective mismatch in your code?")
    killed = ("gone", -int(signal.SIGKILL), "")
    assert failure_of([killed, abort]) == (
        "aborted", "rank 1: killed by SIGABRT: what(): ... Is there a distributed collective mismatch in your code?")
    assert failure_of([("unavailable", "TypeError: no compression"), ("ready", {})]) == (
        "unavailable", "rank 0: TypeError: no compression")
    assert failure_of([("hung", 300.0), ("hung", 300.0)]) == ("hung", "rank 0: no reply in 300 s")
    assert failure_of([("error", "RuntimeError: Connection reset by peer"), killed])[0] == "aborted"


def test_the_telling_line_of_a_log_is_glooʼs_abort() -> None:
    log = ("[W] something\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
           "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. Is there a distributed "
           "collective mismatch in your code?\nFatal Python error: Aborted\n")
    assert "collective mismatch" in telling_line(log)
    assert telling_line("line one\nRuntimeError: boom\n\n") == "RuntimeError: boom"
    assert telling_line("") == ""
    assert telling_line("x" * 500, limit=10) == "xxxxxxx..."


# --- the command line --------------------------------------------------------------------------------------

def test_without_root_link_exits_with_what_to_do(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(namespaces, "is_root", lambda: False)
    monkeypatch.setattr(namespaces.sys, "platform", "linux")
    assert main(["--link", "200mbit", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "needs root: it builds two network namespaces joined by a veth pair" in err
    assert "Run it as root" in err and "without root, run the benchmark without --link" in err


def test_without_ip_or_tc_link_says_what_to_install(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(namespaces, "is_root", lambda: True)
    monkeypatch.setattr(namespaces.sys, "platform", "linux")
    monkeypatch.setattr(namespaces.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/" + tool)
    assert main(["--link", "1gbit"]) == 1
    assert "needs the `tc` command(s) of iproute2 on PATH" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--link", "fast"], "--link='fast' is not a link rate"),
    (["--link", "200mbit", "--contenders", "ddp,nope"], "--contenders: 'nope' unknown; choose from local, ddp"),
    (["--link", "200mbit", "--tasks", "charlm,charlm"], "--tasks names charlm more than once"),
    (["--link", "200mbit", "--workloads", "mlp"], "--workloads belong(s) to the step-time benchmark"),
    (["--tasks", "charlm"], "--tasks only go(es) with --link RATE"),
    (["--link", "200mbit", "--powersgd-rank", "0"], "--powersgd-rank=0 must be an integer of at least 1"),
    (["--link", "200mbit", "--link-rounds", "0"], "--link-rounds=0 must be an integer of at least 1"),
    (["--link-rounds", "12"], "--link-rounds only go(es) with --link RATE"),
])
def test_bad_link_flags_are_usage_errors(argv: List[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_link_config_probes_about_a_second_of_the_link() -> None:
    assert LinkConfig(10**9).probe_bytes == 20 * 2**20
    assert LinkConfig(10**6).probe_bytes == 256 * 2**10
    assert LinkConfig(10**6).collective_timeout_s() > LinkConfig(10**9).collective_timeout_s() == 120.0


# --- processes: an abort on loopback, and the namespaces as root ----------------------------------------------

class _Loopback:
    """Two 'hosts' on loopback, no namespaces: the supervisor's machinery without root."""

    hosts = (Host("", "lo", "127.0.0.1"), Host("", "lo", "127.0.0.1"))

    def exec_prefix(self, host: Host) -> List[str]:
        return []


@pytest.mark.timeout(120)
def test_a_contender_that_aborts_is_reported_and_its_peer_ended(tmp_path: Path) -> None:
    cores = [0, 1 % (os.cpu_count() or 1)]
    with socket.socket() as s:  # a free port for the contender's store (another suite may run beside this one)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Supervisor(_Loopback(), cores, tmp_path) as sup:  # type: ignore[arg-type]
        jobs = [Job("mlp", "local", rank, 2, "127.0.0.1", port, 0, ContenderOptions(), 30.0,
                    str(tmp_path / f"local{rank}.log")) for rank in range(2)]
        ready = sup.start_contender("mlp/local", jobs, 60)
        assert [reply[0] for reply in ready] == ["ready", "ready"], ready
        steps = sup.request("mlp/local", ("steps", 2, True), 60)
        assert [len(reply[1]) for reply in steps] == [2, 2]
        os.kill(ready[1][1]["pid"], signal.SIGABRT)  # as gloo's enforce does on a collective mismatch
        replies = sup.request("mlp/local", ("steps", 1, True), 60)
        # rank 0 fails in the barrier before the step (its peer is gone) or is ended by the supervisor:
        # either way the reason is rank 1's abort
        assert replies[0][0] in ("error", "gone"), replies
        assert failure_of(replies)[1].startswith("rank 1: killed by SIGABRT")
        sup.kill("mlp/local")
    # leaving the block ends the hosts; the fixture checks that no process is left


def _root_with_ip() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and the ip and tc commands to build network namespaces")


def test_the_shaped_link_is_built_shaped_and_removed() -> None:
    _root_with_ip()
    link = ShapedLink(200 * 10**6)  # named after this process: a later run sweeps them if it is killed
    try:
        link.build()
    except namespaces.LinkUnavailableError as exc:
        pytest.skip(f"cannot build network namespaces here: {exc}")
    a, b = link.hosts
    try:
        assert {a.namespace, b.namespace} <= set(namespaces.list_namespaces())
        qdisc = subprocess.run(["tc", "-n", b.namespace, "qdisc", "show", "dev", b.interface], capture_output=True,
                               text=True, check=True).stdout
        assert "tbf" in qdisc and "rate 200Mbit" in qdisc
        # A raw TCP transfer through it (the probe module alone: no torch to import): shaped, far
        # below what an unshaped veth carries (several Gbit/s). No lower bound: a busy machine is slower.
        code = ("import runpy, sys, json; m = runpy.run_path(sys.argv[1]); "
                "print(json.dumps(m[sys.argv[2]](sys.argv[3], 29599, 2 << 20)))")
        server = subprocess.Popen(["ip", "netns", "exec", a.namespace, sys.executable, "-c", code, str(PROBE),
                                   "serve", a.address], stdout=subprocess.PIPE, text=True)
        try:
            client = subprocess.run(["ip", "netns", "exec", b.namespace, sys.executable, "-c", code, str(PROBE),
                                     "send", a.address], capture_output=True, text=True, timeout=60)
            out, _ = server.communicate(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        assert client.returncode == 0, client.stderr
        mbit = json.loads(out)["mbit_s"]
        assert 0 < mbit < 1.1 * 200, mbit
    finally:
        link.close()
    assert not {a.namespace, b.namespace} & set(namespaces.list_namespaces())


def test_namespaces_of_killed_runs_are_swept() -> None:
    _root_with_ip()
    dead = 2**22 + 12345  # above the default pid_max, so no process has it
    name = f"{namespaces.NAMESPACE_PREFIX}-{dead}-a"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:  # a container without the privileges, say
        pytest.skip(f"cannot build network namespaces here (ip netns add: {made.stderr.strip()})")
    try:
        assert name in namespaces.sweep_stale()
        assert name not in namespaces.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
