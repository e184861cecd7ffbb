"""The main job, examples/train_digits.py, run for a few short epochs as users run it."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional, Tuple

import pytest

from distopt._testing import kill_tree, run_command

TIMEOUT = 240  # seconds for one run
# The first test to ask for the runs waits for all of them, SIDE_BY_SIDE at a time (below).
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(2 * TIMEOUT + 60)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_digits.py"
EPOCH_LINE = re.compile(r"^epoch\s+(\d+)/(\d+)\s+loss (\d+\.\d+)\s+test acc (\d+\.\d+)%", re.MULTILINE)
# One epoch of ~23 steps lifts a 10-class model well above chance (10%): about 75% with
# AdamW and 40% with SGD (it starts slower); the bounds leave room for noise.
MIN_ONE_EPOCH_ACCURACY = {"adamw": 50.0, "sgd": 25.0}


def _run(args: List[str], tmp_path: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    # Past the timeout the whole tree goes, torchrun's workers (sessions of their own) included.
    code, out, err = run_command(args, tmp_path, env, TIMEOUT)
    assert code is not None, f"timed out after {TIMEOUT} s\nstdout:\n{out}\nstderr:\n{err}"
    return subprocess.CompletedProcess(args, code, out, err)


def _check_one_epoch(proc: subprocess.CompletedProcess, ranks: int, optimizer: str = "adamw") -> None:
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = EPOCH_LINE.findall(proc.stdout)
    assert len(lines) == 1, f"expected one epoch line in:\n{proc.stdout}"
    epoch, epochs, loss, accuracy = lines[0]
    assert (epoch, epochs) == ("1", "1")
    assert float(loss) > 0
    assert float(accuracy) >= MIN_ONE_EPOCH_ACCURACY[optimizer], proc.stdout
    assert f"{ranks} rank(s)" in proc.stdout
    assert "bitwise identical" in proc.stdout


TORCHRUN_SGD = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPT), "--epochs", "4", "--optimizer", "sgd"]
# The runs of the examples that the tests below check, by name: the command line ({tmp}: the run's own
# directory) and, for torchrun, the environment, which imports this checkout. The longest first.
RUNS = {
    # Under torchrun, uninterrupted: checked on its own, and the result a killed run must reach.
    "torchrun sgd": (TORCHRUN_SGD, dict(os.environ, PYTHONPATH=str(ROOT))),
    "two processes with plot": ([sys.executable, str(SCRIPT), "--epochs", "1", "--plot", "{tmp}/digits.png"], None),
    "compressed small packs": ([sys.executable, str(SCRIPT), "--epochs", "1", "--compression", "bf16",
                                "--pack-threshold", "16K", "--bcast-period", "5"], None),
    "diloco": ([sys.executable, str(SCRIPT), "--epochs", "1", "--sync-every", "4", "--outer-lr", "0.7",
                "--curves", "{tmp}/runs.json", "--plot", "{tmp}/runs.png"], None),
    "single process": ([sys.executable, str(SCRIPT), "--epochs", "1", "--nprocs", "1"], None),
    "ddp migration": ([sys.executable, str(ROOT / "examples" / "migrate_from_ddp.py")], None),
}
SIDE_BY_SIDE = 3  # runs at a time: much of each is start-up, one process at a time


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Tuple[Future, Path]]:
    """Every run of RUNS, SIDE_BY_SIDE at a time, to its end: name -> (its outcome, its directory)."""
    dirs = {name: tmp_path_factory.mktemp(name.replace(" ", "-")) for name in RUNS}
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        futures = {name: pool.submit(_run, [part.format(tmp=dirs[name]) for part in cmd], dirs[name], env)
                   for name, (cmd, env) in RUNS.items()}
    return {name: (future, dirs[name]) for name, future in futures.items()}


def _finished(runs: Dict[str, Tuple[Future, Path]], name: str) -> Tuple[subprocess.CompletedProcess, Path]:
    """The finished run ``name`` of ``runs`` and its directory; a run that timed out fails the test that reads it."""
    future, directory = runs[name]
    return future.result(), directory


def test_two_processes_one_epoch_with_plot(runs: Dict[str, Tuple[Future, Path]]) -> None:
    proc, tmp_path = _finished(runs, "two processes with plot")
    _check_one_epoch(proc, ranks=2)
    assert (tmp_path / "digits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compressed_small_packs(runs: Dict[str, Tuple[Future, Path]]) -> None:
    proc, _ = _finished(runs, "compressed small packs")
    _check_one_epoch(proc, ranks=2)
    assert "compression bf16" in proc.stdout


def test_diloco_every_4_steps_with_curves_and_plot(runs: Dict[str, Tuple[Future, Path]]) -> None:
    proc, tmp_path = _finished(runs, "diloco")
    _check_one_epoch(proc, ranks=2)  # the join block's end syncs the steps after the last sync
    assert "DiLoCo H=4" in proc.stdout
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run,) = json.loads((tmp_path / "runs.json").read_text())
    assert run["label"] == "DiLoCo H=4" and len(run["history"]) == 1
    # 23 steps, a sync every 4th: 5 of the ~150 KiB rounds synchronous training sends at every step
    assert 0 < run["bytes_per_step"] < 0.25 * 150 * 1024


def test_single_process_without_process_group(runs: Dict[str, Tuple[Future, Path]]) -> None:
    proc, _ = _finished(runs, "single process")
    _check_one_epoch(proc, ranks=1)
    assert "no process group" in proc.stdout


@pytest.fixture(scope="module")
def torchrun_sgd_run(runs: Dict[str, Tuple[Future, Path]]) -> subprocess.CompletedProcess:
    """The example under torchrun, uninterrupted: checked on its own, and the result a killed run must reach."""
    return _finished(runs, "torchrun sgd")[0]


def test_under_torchrun(torchrun_sgd_run: subprocess.CompletedProcess) -> None:
    proc = torchrun_sgd_run
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = EPOCH_LINE.findall(proc.stdout)
    assert [(epoch, epochs) for epoch, epochs, _, _ in lines] == [(str(e), "4") for e in range(1, 5)], proc.stdout
    assert float(lines[0][3]) >= MIN_ONE_EPOCH_ACCURACY["sgd"], proc.stdout
    assert float(lines[-1][2]) < float(lines[0][2]), proc.stdout  # the loss falls over the epochs
    assert "2 rank(s)" in proc.stdout and "bitwise identical" in proc.stdout


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_digits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--nprocs", "0"], "--nprocs must be at least 1"),
        (["--pack-threshold", "ten"], "is not a byte count"),
        (["--compression", "int2"], "invalid choice"),
        (["--sync-every", "0"], "--sync-every must be at least 1"),
    ],
)
def test_bad_flags_are_rejected(argv: List[str], message: str, capsys: pytest.CaptureFixture) -> None:
    example = _load_example()
    with pytest.raises(SystemExit, match="^2$") as exc:
        example.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_flag_defaults() -> None:
    example = _load_example()
    args = example.parse_args([])
    assert (args.optimizer, args.compression, args.bcast_period) == ("adamw", "none", 0)
    assert args.lr == pytest.approx(3e-3)
    assert example.parse_args(["--pack-threshold", "256K"]).pack_threshold == 256 * 1024
    assert example.parse_args(["--optimizer", "sgd"]).lr == pytest.approx(0.05)


def _final_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("final test accuracy")]
    assert lines, out
    return lines[-1].split(" in ")[0]  # "final test accuracy 95.82% after 3 epochs"


@pytest.mark.timeout(300)
def test_a_worker_killed_mid_training_restarts_and_resumes_to_the_same_result(
        tmp_path: Path, torchrun_sgd_run: subprocess.CompletedProcess) -> None:
    """torchrun --max-restarts 1: a worker killed after an epoch's checkpoint resumes from it, and the
    job ends with the final accuracy of an uninterrupted run."""
    import signal
    import time

    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = TORCHRUN_SGD[:6] + ["--max-restarts", "1"] + TORCHRUN_SGD[6:]
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(command + ["--checkpoint-dir", str(ckpt)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr.log", "w"), start_new_session=True)
    killed = False
    out: List[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if not killed and line.startswith("epoch   2/4"):
                # Rank 1, once both ranks' epoch-2 checkpoints are on disk, in epoch 3. Rank 0 prints the
                # epoch before the ranks save it: a kill at the print alone once landed before the saves
                # under a loaded host, and the job resumed after epoch 1.
                worker = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                              if "train_digits.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1")
                saved = [ckpt / f"epoch0002-rank{rank}.pt" for rank in (0, 1)]
                deadline = time.monotonic() + 30
                while not all(path.exists() for path in saved) and time.monotonic() < deadline:
                    time.sleep(0.005)
                worker.send_signal(signal.SIGKILL)
                killed = True
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    plain = torchrun_sgd_run
    assert plain.returncode == 0, plain.stdout + plain.stderr
    text = "".join(out)
    assert killed and proc.returncode == 0, text
    assert "resumed from" in text and "after epoch 2" in text, text
    assert _final_line(text) == _final_line(plain.stdout), (text, plain.stdout)
    assert "bitwise identical" in text


def test_the_ddp_migration_example_ends_with_ddps_parameters(runs: Dict[str, Tuple[Future, Path]]) -> None:
    proc, _ = _finished(runs, "ddp migration")
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for shard_state in ("False", "True"):
        assert re.search(rf"shard_state={shard_state} +world 2: parameters match DDP's \(max difference "
                         r"\d\.\de[+-]\d+\); ranks bitwise identical: True", proc.stdout), proc.stdout
    assert "the merged per-rank shards equal it: True" in proc.stdout
