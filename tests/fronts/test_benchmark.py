"""Smoke tests of ``python -m distopt.benchmark``: tiny iteration counts, no performance asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

from distopt import benchmark
from distopt._testing import run_command
from distopt.benchmark import WORKLOADS, BenchConfig, ModeResult, WorkloadResult, format_size, parse_size

TIMEOUT = 480  # all three runs of the command below (~20 s on an idle 2-core machine)
# Past TIMEOUT the runs' whole process tree is killed, before the test's own timeout fires.
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(TIMEOUT + 60)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--iters", "1", "--rounds", "2", "--warmup", "1"]

# The runs of ``python -m distopt.benchmark`` that the tests below check, one after another in one
# process, each as ``-m`` runs it (``runpy``, with its own argv): the process pays for Python, torch
# and the fork server its launches' workers start from once, rather than once per run. Each run's
# stdout and stderr begin with a line of SEPARATOR; its exit status follows it on stdout.
SEPARATOR = "=== the next run of python -m distopt.benchmark ==="
DRIVER = f"""
import json, runpy, sys, traceback
for argv in json.loads(sys.argv[1]):
    for stream in (sys.stdout, sys.stderr):
        print({SEPARATOR!r}, file=stream, flush=True)
    sys.argv = ["distopt.benchmark", *argv]
    try:
        runpy.run_module("distopt.benchmark", run_name="__main__", alter_sys=True)
        code = "none: no sys.exit"
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = "none: it raised"
    print(f"exit code {{code}}", flush=True)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, subprocess.CompletedProcess]:
    """Every run the tests check, by name: its argv, exit status, stdout and stderr."""
    tmp = tmp_path_factory.mktemp("benchmark")
    argvs = {
        # Without the peak-memory probes, a fresh two-process launch each (half this run's time with
        # them): test_a_memory_probe_measures_a_modes_growth checks what a probe measures.
        "two ranks": ["--workloads", "mlp", *TINY, "--thresholds", "0", "--sweep", str(tmp / "sweep.png"),
                      "--json", str(tmp / "bench.json"), "--no-memory"],
        "world one": ["--world", "1", "--iters", "1", "--rounds", "1", "--warmup", "1", "--json"],
        "profile": ["--profile", "mlp", "--iters", "1", "--rounds", "1", "--warmup", "1"],  # one profiled step a mode
    }
    cmd = [sys.executable, "-c", DRIVER, json.dumps(list(argvs.values()))]
    code, out, err = run_command(cmd, ROOT, None, TIMEOUT)  # past the timeout, its workers go too
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err}"
    outs, errs = out.split(SEPARATOR + "\n")[1:], err.split(SEPARATOR + "\n")[1:]
    assert len(outs) == len(errs) == len(argvs), f"stdout:\n{out}\nstderr:\n{err}"
    done = {}
    for (name, argv), run_out, run_err in zip(argvs.items(), outs, errs):
        run_out, _, status = run_out.rpartition("exit code ")
        assert status == "0\n", f"{name}: exit code {status}stdout:\n{run_out}\nstderr:\n{run_err}"
        done[name] = subprocess.CompletedProcess(argv, 0, run_out, run_err)
    return done


def test_two_ranks_all_sections(runs: Dict[str, subprocess.CompletedProcess]) -> None:
    proc = runs["two ranks"]
    out, png = Path(proc.args[proc.args.index("--json") + 1]), Path(proc.args[proc.args.index("--sweep") + 1])
    for text in ("[mlp]", "ratio distopt/ddp", "bare_allreduce", "distopt@0B", "[world size 1]"):
        assert text in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    (workload,) = report["distributed"]
    modes = workload["modes"]
    assert set(modes) == {"local", "ddp", "distopt", "distopt@0", "bare_allreduce"}
    # 2 rounds of ceil(iters * iters_scale / rounds) steps; mlp's iters_scale is 5
    assert all(len(m["times_ms"]) == 2 * 3 for m in modes.values())
    assert modes["local"]["allreduce_calls"] == 0
    assert modes["ddp"]["allreduce_calls"] >= 1
    assert modes["distopt"]["allreduce_calls"] >= 1
    # threshold 0: one all-reduce per parameter
    assert modes["distopt@0"]["allreduce_calls"] == workload["num_params"] == 100
    assert all(m["peak_mem_bytes"] is None for m in modes.values())  # not probed, and not shown as 0
    assert workload["ratio"] > 0
    assert [w["name"] for w in report["world1"]] == ["mlp"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", ["local", "distopt"])
def test_a_memory_probe_measures_a_modes_growth(mode: str) -> None:
    """What a probe's fresh process runs, here in this one: the mode's model and gradients are 128 MiB each."""
    from distopt.benchmark.memory import memory_worker

    threads = torch.get_num_threads()
    try:
        grown = memory_worker(BenchConfig(world=1, warmup=1), "wide", mode)
    finally:
        torch.set_num_threads(threads)  # the probe gives itself the cores, as a rank would
    gradients = sum(p.numel() * 4 for p in WORKLOADS["wide"].build_model().parameters())
    assert gradients > 128 * 2**20
    # parameters and gradients, built after the mark was reset, and the optimizer's momentum
    assert grown is not None and 2 * gradients <= grown < 5 * gradients, (grown, gradients)


def test_world_one_every_workload_json_to_stdout(runs: Dict[str, subprocess.CompletedProcess]) -> None:
    proc = runs["world one"]
    report = json.loads(proc.stdout)
    assert report["distributed"] == []
    assert [w["name"] for w in report["world1"]] == ["mlp", "wide", "transformer", "conv", "embedding"]
    for workload in report["world1"]:
        assert set(workload["modes"]) == {"local", "distopt"}
        assert workload["modes"]["distopt"]["allreduce_calls"] == 0
    assert report["world1"][1]["grad_bytes"] > 100 * 2**20


@pytest.mark.parametrize(
    "text, expected",
    [("0", 0), ("65536", 65536), ("256K", 256 * 2**10), ("1MiB", 2**20), ("25MB", 25 * 2**20), ("1.5M", 3 * 2**19)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "ten", "5 parsecs"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a byte count"):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 512, 2**10, 10 * 2**20, 3 * 2**19, 2**30)] == [
        "0B", "512B", "1KiB", "10MiB", "1.5MiB", "1GiB"
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workloads": ("mlp", "resnet")}, "workloads=\\['resnet'\\] are unknown"),
        ({"world": 0}, "world=0 must be at least 1"),
        ({"iters": 0}, "iters=0 must be at least 1"),
        ({"warmup": 0}, "warmup=0 must be at least 1"),
        ({"thresholds": (-1,)}, "thresholds=\\[-1\\] must be non-negative"),
    ],
)
def test_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


def _result(local: float, ddp: float, distopt: float) -> WorkloadResult:
    modes = {name: ModeResult(name, ms, ms, ms) for name, ms in (("local", local), ("ddp", ddp), ("distopt", distopt))}
    return WorkloadResult("mlp", "", 2, 1, 4, modes)


def test_ratio_and_overhead() -> None:
    result = _result(local=10.0, ddp=20.0, distopt=15.0)
    assert result.ratio == pytest.approx(0.75)
    assert result.overhead == pytest.approx(0.5)
    # DDP within 5% of the floor: the overhead is reported as undefined, not as noise over ~0.
    assert _result(local=10.0, ddp=10.4, distopt=12.0).overhead is None
    assert benchmark.format_report({
        "config": {"world": 2, "backend": "gloo", "iters": 1, "rounds": 1},
        "environment": {"device": "cpu", "torch": "x", "cpu_cores": 2, "distopt_default_pack_threshold": 2**20},
        "distributed": [result], "world1": [],
    }).count("ratio distopt/ddp = 0.750") == 1


def test_the_drift_checks_cost_is_one_checks_time_over_the_default_period() -> None:
    result = _result(local=10.0, ddp=20.0, distopt=15.0)
    for name, ms in (("distopt-nodrift", 15.0), ("distopt+drift1", 18.0)):
        result.modes[name] = ModeResult(name, ms, ms, ms)
    text = benchmark.format_report({
        "config": {"world": 2, "backend": "gloo", "iters": 1, "rounds": 1},
        "environment": {"device": "cpu", "torch": "x", "cpu_cores": 2, "distopt_default_pack_threshold": 2**20},
        "distributed": [result, _result(local=10.0, ddp=20.0, distopt=15.0)], "world1": [],
    })
    # 3 ms a check, every 100 steps: 0.03 ms of a 15 ms step; only where both modes ran.
    assert text.count("drift check: 3.00 ms a check (distopt+drift1 - distopt-nodrift); every 100 steps "
                      "(the default) 0.030 ms a step = 0.20% of a distopt step") == 1


def test_profile_prints_each_modes_phases_and_top_operators(runs: Dict[str, subprocess.CompletedProcess]) -> None:
    proc = runs["profile"]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.strip().startswith("phase"))
    assert header.split() == ["phase", "local", "ddp", "distopt"]
    backward = next(line for line in lines if line.strip().startswith("backward")).split()
    assert all(float(v) > 0 for v in backward[1:]), proc.stdout
    wait = next(line for line in lines if line.strip().startswith("distopt.wait")).split()
    assert float(wait[1]) == 0.0 and float(wait[2]) == 0.0  # only distopt waits on its own packs
    assert "top self-CPU operators, distopt:" in proc.stdout
