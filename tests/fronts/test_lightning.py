"""distopt under Lightning: ``Trainer(strategy=DistoptStrategy(...))`` trains like ``strategy="ddp"``.

One launch of tests/_scripts/lightning_train.py (Lightning's own launcher, 2 CPU ranks, gloo)
trains the same LightningModule several ways; each test compares the parameters it saved.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

from distopt._testing import run_command

pytest.importorskip("pytorch_lightning")
from distopt.lightning import DistoptStrategy  # noqa: E402  (after the skip: an optional dependency)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "_scripts" / "lightning_train.py"
RUNS = ["initial", "ddp", "distopt", "ddp-accumulate-clip", "distopt-accumulate-clip", "ddp-bf16", "distopt-bf16",
        "distopt-resumed", "distopt-sharded-resumed", "distopt-int8", "distopt-int8-resumed", "distopt-local-sgd",
        "distopt-diloco", "distopt-streaming"]
TIMEOUT = 240


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code, stdout, stderr = run_command([sys.executable, SCRIPT, out, *RUNS], out, env, TIMEOUT)
    assert code == 0, f"exit code {code}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-8000:]}"
    return out


def _params(out: Path, run: str, rank: int = 0) -> Dict[str, torch.Tensor]:
    return torch.load(out / f"{run}-rank{rank}.pt")


def _assert_bitwise(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {(a[name] - b[name]).abs().max().item():g}"


@pytest.mark.parametrize("ddp, distopt", [
    ("ddp", "distopt"),
    ("ddp-accumulate-clip", "distopt-accumulate-clip"),  # accumulate_grad_batches=2, gradient_clip_val
    ("ddp-bf16", "distopt-bf16"),  # precision="bf16-mixed"
    ("ddp", "distopt-resumed"),  # ModelCheckpoint, then ckpt_path=
    ("ddp", "distopt-sharded-resumed"),  # shard_state=True: the state gathered into the checkpoint
])
def test_trains_bitwise_like_the_ddp_strategy(trained, ddp, distopt):
    for rank in (0, 1):
        _assert_bitwise(_params(trained, ddp, rank), _params(trained, distopt, rank))


def test_a_resume_gives_each_rank_its_own_error_feedback(trained):
    _assert_bitwise(_params(trained, "distopt-int8"), _params(trained, "distopt-int8-resumed"))


@pytest.mark.parametrize("run", ["distopt", "distopt-int8", "distopt-local-sgd", "distopt-diloco"])
def test_ranks_end_identical_where_the_mode_promises_it(trained, run):
    # Local SGD and DiLoCo sync every 4 steps, and 16 were taken: the last step was a sync.
    _assert_bitwise(_params(trained, run, 0), _params(trained, run, 1))


def test_streaming_diloco_trains(trained):
    # Its fragments sync at staggered steps, so between syncs the replicas differ on purpose.
    start, end = _params(trained, "initial"), _params(trained, "distopt-streaming")
    assert all(torch.isfinite(v).all() for v in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in end)


def test_an_option_the_wrapper_does_not_take_is_refused():
    with pytest.raises(TypeError, match="sync_evry=4"):
        DistoptStrategy(sync_evry=4)
    with pytest.raises(TypeError, match="named_parameters"):
        DistoptStrategy(named_parameters=[])


def test_fault_tolerance_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="fault_tolerance= is not supported under Lightning.*distopt.fault_tolerance.launch"):
        DistoptStrategy(fault_tolerance=object())
