"""Train a small CNN on scikit-learn's handwritten digits, data-parallel with distopt.

The digits (1797 8x8 images bundled with scikit-learn, no download) are split
80/20 into train and test sets. Every rank trains on its own shard of the
training set (``DistributedSampler``) through a :class:`distopt.DistributedOptimizer`,
evaluates on its shard of the test set, and the metrics are summed over ranks.
At the end the ranks compare their parameters, which must be bitwise identical;
the script exits with status 1 if they are not.

Usage::

    python examples/train_digits.py                        # 2 processes, CPU, gloo
    python examples/train_digits.py --epochs 20 --nprocs 4 --plot digits.png
    python examples/train_digits.py --compression bf16     # 16-bit gradients on the wire (or int8, powersgd, ...)
    python examples/train_digits.py --nprocs 1             # this process only, no process group
    python examples/train_digits.py --sync-every 16        # local SGD: average parameters every 16 steps
    python examples/train_digits.py --sync-every 16 --outer-lr 0.7   # DiLoCo: outer Nesterov SGD
    python examples/train_digits.py --sync-every 16 --curves runs.json --label H16 --plot runs.png
    torchrun --nproc-per-node 2 examples/train_digits.py   # the same script, started by torchrun

Rank 0 shows a progress bar and prints one line per epoch: mean training
loss, test accuracy, optimizer steps per second and bytes all-reduced per step.
With ``--sync-every H`` the ranks train alone between syncs, so an epoch's test
accuracy is that of each rank's own replica on its shard; the loop runs inside
``opt.join()``, whose end averages the steps not synced yet, and the final
accuracy is that of the common model.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distopt
from distopt.wrapper import DEFAULT_PACK_THRESHOLD

__all__ = ["DigitsCNN", "EpochMetrics", "TrainResult", "load_digits_split", "parse_args", "train", "main"]

_OPTIMIZERS = ("adamw", "adam", "sgd")
_DEFAULT_LR = {"adamw": 3e-3, "adam": 3e-3, "sgd": 0.05}
_SIZE_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}

Split = Tuple[Tensor, Tensor, Tensor, Tensor]


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers: about 40k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


@dataclass
class EpochMetrics:
    """One epoch, summed over all ranks.

    Attributes:
        epoch: 1-based epoch number.
        loss: mean training loss over the epoch's samples.
        test_loss: mean loss on the test set.
        test_accuracy: fraction of test digits classified correctly.
        steps_per_second: optimizer steps per second of training time on rank 0.
        bytes_per_step: bytes all-reduced per step on rank 0 (averaged over the epoch's steps).
    """

    epoch: int
    loss: float
    test_loss: float
    test_accuracy: float
    steps_per_second: float
    bytes_per_step: float


@dataclass
class TrainResult:
    """What each rank returns.

    Attributes:
        rank: this rank.
        world_size: ranks that trained.
        history: per-epoch metrics.
        seconds: wall time of the training loop.
        identical: whether all ranks ended with bitwise-identical parameters.
        test_accuracy: of the final model (after the last sync, in local SGD).
        bytes_per_step: bytes all-reduced per training step, over the whole run.
    """

    rank: int
    world_size: int
    history: List[EpochMetrics] = field(default_factory=list)
    seconds: float = 0.0
    identical: bool = False
    test_accuracy: float = math.nan
    bytes_per_step: float = 0.0


def load_digits_split(seed: int, test_fraction: float = 0.2) -> Split:
    """The digits as ``(x_train, y_train, x_test, y_test)``; images are ``N x 1 x 8 x 8`` in ``[0, 1]``.

    The split is stratified (``test_fraction`` of each digit) and depends only on
    ``seed``, so every rank gets the same one.
    """
    images, labels = _read_digits()
    generator = torch.Generator().manual_seed(seed)
    train_idx, test_idx = [], []
    for digit in range(10):
        idx = (labels == digit).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        cut = round(len(idx) * test_fraction)
        test_idx.append(idx[:cut])
        train_idx.append(idx[cut:])
    train, test = torch.cat(train_idx), torch.cat(test_idx)
    return images[train], labels[train], images[test], labels[test]


def _read_digits() -> Tuple[Tensor, Tensor]:
    """scikit-learn's bundled digits, read straight from its data file.

    Reading the file rather than calling ``sklearn.datasets.load_digits`` spares
    every worker the import of scikit-learn, which only slows the start.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits come with scikit-learn, which is not installed: pip install -e '.[examples]'")
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    images = torch.tensor(data[:, :-1], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return images, torch.tensor(data[:, -1], dtype=torch.long)


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count; write e.g. 0, 65536, 256K or 10MiB")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; see ``--help``."""
    p = argparse.ArgumentParser(description="Data-parallel CNN training on scikit-learn's digits with distopt.")
    p.add_argument("--nprocs", type=int, default=None,
                   help="worker processes to spawn (default 2; 1 trains in this process without a process group; "
                        "ignored under torchrun)")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo; nccl trains on GPUs)")
    p.add_argument("--epochs", type=int, default=12, help="passes over the training set (default 12)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: " + ", ".join(f"{k} {v:g}" for k, v in _DEFAULT_LR.items()) + ")")
    p.add_argument("--optimizer", choices=_OPTIMIZERS, default="adamw",
                   help="inner torch.optim optimizer (default adamw)")
    p.add_argument("--pack-threshold", type=_parse_size, default=DEFAULT_PACK_THRESHOLD,
                   help="bytes per all-reduce pack, e.g. 0, 256K, 10MiB (default: distopt's, 10MiB)")
    p.add_argument("--bcast-period", type=int, default=0,
                   help="re-broadcast parameters from rank 0 every N steps; 0: only at start (default 0)")
    p.add_argument("--compression", choices=("none", *distopt.compression.NAMES), default="none",
                   help="fewer bytes on the wire: "
                        + "; ".join(f"{name}: {entry.sends}" for name, entry in distopt.compression.NAMES.items())
                        + " (default none)")
    p.add_argument("--sync-every", type=int, default=1, metavar="H",
                   help="local SGD: average parameters every H steps, gradients stay local in between "
                        "(default 1: synchronous)")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="DiLoCo: outer Nesterov SGD with this lr on the averaged pseudo-gradient "
                        "(default: plain parameter averaging)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="momentum of the outer SGD (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, model and shuffling (default 0)")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of loss and test accuracy per epoch (of every run in --curves, if given)")
    p.add_argument("--curves", metavar="JSON", help="append this run's per-epoch metrics to this file")
    p.add_argument("--label", default=None, help="this run's name in --curves (default: from the flags)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save every rank's state here after each epoch (atomically), and resume from the latest "
                        "epoch every rank has saved when the job starts again (e.g. torchrun --max-restarts)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "sync_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.nprocs is not None and args.nprocs < 1:
        p.error(f"--nprocs must be at least 1, got {args.nprocs}")
    if args.lr is None:
        args.lr = _DEFAULT_LR[args.optimizer]
    if args.label is None:
        args.label = "synchronous" if args.sync_every == 1 and args.outer_lr is None else (
            f"{'DiLoCo' if args.outer_lr is not None else 'local SGD'} H={args.sync_every}")
    return args


def _make_optimizer(model: nn.Module, args: argparse.Namespace) -> distopt.DistributedOptimizer:
    if args.optimizer == "sgd":
        inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
        inner = cls(model.parameters(), lr=args.lr)
    outer = None
    if args.outer_lr is not None:
        outer = functools.partial(_outer_sgd, lr=args.outer_lr, momentum=args.outer_momentum)
    return distopt.DistributedOptimizer(
        inner,
        pack_threshold=args.pack_threshold,
        bcast_period=args.bcast_period,
        compression=None if args.compression == "none" else args.compression,
        named_parameters=model.named_parameters(),
        sync_every=args.sync_every,
        outer_optimizer=outer,
    )


def _outer_sgd(params: Iterable[Tensor], lr: float, momentum: float) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: Nesterov SGD (plain SGD without momentum)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


def _sum_over_ranks(values: Sequence[float], device: torch.device) -> List[float]:
    """Element-wise sum of ``values`` over all ranks (identity without a process group)."""
    return distopt.collectives.all_reduce(torch.tensor(values, dtype=torch.float64, device=device), op="sum").tolist()


def _param_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _all_identical(model: nn.Module) -> bool:
    """Whether every rank holds bitwise the same parameters (always true in one process)."""
    digest = _param_digest(model)
    return len(set(distopt.collectives.all_gather_object(digest))) == 1


def _train_epoch(model: nn.Module, opt: distopt.DistributedOptimizer, loader: DataLoader, epoch: int,
                 args: argparse.Namespace, rank: int, device: torch.device) -> Tuple[float, int, int, int, float]:
    """One pass over this rank's shard: ``(loss sum, samples, steps, bytes reduced, seconds)``."""
    from tqdm import tqdm

    model.train()
    loss_sum, samples, steps, reduced = 0.0, 0, 0, 0
    start = time.perf_counter()
    bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", disable=rank != 0, leave=False, unit="step")
    for x, y in bar:
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss_sum += loss.item() * len(y)
        samples += len(y)
        steps += 1
        reduced += opt.stats.bytes
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return loss_sum, samples, steps, reduced, time.perf_counter() - start


@torch.no_grad()
def _evaluate(model: nn.Module, x: Tensor, y: Tensor) -> Tuple[float, int, int]:
    """``(loss sum, correct, samples)`` on this rank's test shard."""
    model.eval()
    logits = model(x)
    loss_sum = nn.functional.cross_entropy(logits, y, reduction="sum").item() if len(y) else 0.0
    return loss_sum, int((logits.argmax(dim=1) == y).sum()), len(y)


def train(args: argparse.Namespace, data: Split) -> TrainResult:
    """Train on this rank's shards; runs on every rank (or alone, without a process group).

    Args:
        args: the parsed command line.
        data: ``(x_train, y_train, x_test, y_test)`` from :func:`load_digits_split`.

    Returns:
        This rank's :class:`TrainResult`; ``history`` is filled on every rank.
    """
    rank, world = distopt.get_rank(), distopt.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in args.backend else torch.device("cpu")
    x_train, y_train, x_test, y_test = data

    torch.manual_seed(args.seed)  # same initial model on every rank; the optimizer also broadcasts it
    model = DigitsCNN().to(device)
    opt = _make_optimizer(model, args)
    sampler = DistributedSampler(TensorDataset(x_train, y_train), num_replicas=world, rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, sampler=sampler)
    # An exact test shard (no padding), so every test digit counts once.
    x_shard, y_shard = x_test[rank::world].to(device), y_test[rank::world].to(device)

    if rank == 0:
        _print_header(model, args, world, len(y_train), len(y_test))
    result = TrainResult(rank, world)
    first_epoch = 1
    if args.checkpoint_dir:
        first_epoch = _resume(args.checkpoint_dir, model, opt, result, rank) + 1
    local = args.sync_every > 1 or args.outer_lr is not None
    total_steps = total_bytes = 0
    start = time.perf_counter()
    # Local SGD: the end of the join block averages the steps taken since the last sync (every
    # rank runs as many steps here, so no rank waits; the metric all-reduces stay legal).
    with opt.join() if local else contextlib.nullcontext():
        for epoch in range(first_epoch, args.epochs + 1):
            sampler.set_epoch(epoch)
            loss_sum, samples, steps, reduced, seconds = _train_epoch(model, opt, loader, epoch, args, rank, device)
            total_steps, total_bytes = total_steps + steps, total_bytes + reduced
            test_loss, correct, count = _evaluate(model, x_shard, y_shard)
            loss_sum, samples, test_loss, correct, count = _sum_over_ranks(
                [loss_sum, samples, test_loss, correct, count], device
            )
            metrics = EpochMetrics(epoch, loss_sum / samples, test_loss / count, correct / count,
                                   steps / seconds, reduced / steps)
            result.history.append(metrics)
            if rank == 0:
                _print_epoch(metrics, args.epochs)
            if args.checkpoint_dir:
                _save(args.checkpoint_dir, epoch, model, opt, result, rank)
    result.seconds = time.perf_counter() - start
    result.bytes_per_step = total_bytes / max(total_steps, 1)
    result.test_accuracy = result.history[-1].test_accuracy if result.history else math.nan
    if local:  # the common model, after the last sync
        _, correct, count = _sum_over_ranks(list(_evaluate(model, x_shard, y_shard)), device)
        result.test_accuracy = correct / count
    result.identical = _all_identical(model)
    if rank == 0:
        _print_footer(result)
        if args.curves:
            _append_curves(args.curves, args.label, result)
        if args.plot:
            _plot(_read_curves(args.curves) if args.curves else {args.label: result.history}, args.plot)
    opt.close()
    return result


def _checkpoint_path(directory: str, epoch: int, rank: int) -> Path:
    return Path(directory) / f"epoch{epoch:04d}-rank{rank}.pt"


def _save(directory: str, epoch: int, model: nn.Module, opt: distopt.DistributedOptimizer, result: TrainResult,
          rank: int) -> None:
    """This rank's state after ``epoch``, written atomically: a kill mid-write leaves the previous one."""
    state = {"epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "history": [vars(m) for m in result.history], "rng": torch.get_rng_state()}
    path = _checkpoint_path(directory, epoch, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: the name points at a whole file or at none
    for old in Path(directory).glob(f"epoch*-rank{rank}.pt"):
        if old != path and int(old.name[5:9]) < epoch - 1:  # keep two: the ranks may stop one epoch apart
            old.unlink()


def _resume(directory: str, model: nn.Module, opt: distopt.DistributedOptimizer, result: TrainResult,
            rank: int) -> int:
    """Load the latest epoch that every rank has saved; return it (0: start afresh)."""
    mine = sorted(int(p.name[5:9]) for p in Path(directory).glob(f"epoch*-rank{rank}.pt"))
    everyone = distopt.collectives.all_gather_object(mine)
    common = set(everyone[0]).intersection(*map(set, everyone[1:])) if everyone else set()
    if not common:
        return 0
    epoch = max(common)
    state = torch.load(_checkpoint_path(directory, epoch, rank), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    result.history = [EpochMetrics(**m) for m in state["history"]]
    if rank == 0:
        print(f"resumed from {directory} after epoch {epoch}", flush=True)
    return epoch


def _format_bytes(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _print_header(model: nn.Module, args: argparse.Namespace, world: int, n_train: int, n_test: int) -> None:
    params = sum(p.numel() for p in model.parameters())
    backend = dist.get_backend() if dist.is_initialized() else "no process group"
    print(f"DigitsCNN ({params} parameters) on {n_train} train / {n_test} test digits; {world} rank(s), {backend}; "
          f"global batch {args.batch_size * world}; {args.optimizer} lr {args.lr:g}; "
          f"pack_threshold {_format_bytes(args.pack_threshold)}; compression {args.compression}; "
          f"{args.label}", flush=True)


def _print_epoch(metrics: EpochMetrics, epochs: int) -> None:
    print(f"epoch {metrics.epoch:>3}/{epochs}  loss {metrics.loss:.4f}  "
          f"test acc {100 * metrics.test_accuracy:.2f}%  steps/s {metrics.steps_per_second:.1f}  "
          f"all-reduced/step {_format_bytes(metrics.bytes_per_step)}", flush=True)


def _print_footer(result: TrainResult) -> None:
    verdict = "bitwise identical" if result.identical else "DIFFERENT (replicas diverged)"
    print(f"final test accuracy {100 * result.test_accuracy:.2f}% after {len(result.history)} epochs in "
          f"{result.seconds:.1f} s ({_format_bytes(result.bytes_per_step)} all-reduced per step); "
          f"parameters on all {result.world_size} rank(s): {verdict}", flush=True)


def _append_curves(path: str, label: str, result: TrainResult) -> None:
    """Add this run to the JSON file of runs that ``--plot`` compares (replacing a run of the same label)."""
    runs = [r for r in (json.loads(Path(path).read_text()) if Path(path).exists() else []) if r["label"] != label]
    runs.append({"label": label, "final_test_accuracy": result.test_accuracy,
                 "bytes_per_step": result.bytes_per_step, "history": [vars(m) for m in result.history]})
    Path(path).write_text(json.dumps(runs, indent=1))


def _read_curves(path: str) -> "dict[str, List[EpochMetrics]]":
    return {r["label"]: [EpochMetrics(**m) for m in r["history"]] for r in json.loads(Path(path).read_text())}


def _plot(runs: "dict[str, Sequence[EpochMetrics]]", path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for label, history in runs.items():
        epochs = [m.epoch for m in history]
        line = ax_loss.plot(epochs, [m.loss for m in history], "o-", label=f"{label} train")[0]
        if len(runs) == 1:  # one run: its test loss too; several: one line each stays readable
            ax_loss.plot(epochs, [m.test_loss for m in history], "s--", label=f"{label} test")
        ax_acc.plot(epochs, [100 * m.test_accuracy for m in history], "o-", color=line.get_color(), label=label)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    ax_loss.legend(fontsize="small")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    if len(runs) > 1:
        ax_acc.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the example; returns 0, or 1 if the ranks' parameters differ at the end."""
    args = parse_args(argv)
    data = load_digits_split(args.seed)
    if args.nprocs == 1 and not _under_torchrun():
        results = [train(args, data)]  # no process group: the wrapper is the plain optimizer
    else:  # under torchrun, launch runs train once in this process instead of spawning
        results = distopt.launch(train, nprocs=args.nprocs or 2, args=(args, data), backend=args.backend)
    if not all(r.identical for r in results):
        print("error: ranks ended with different parameters", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
