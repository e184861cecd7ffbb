"""The command line, ``python -m distopt.benchmark``: flags to a :class:`BenchConfig`, figures to stdout."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

from ..wrapper.optimizer import DEFAULT_PACK_THRESHOLD
from .config import BenchConfig
from .slow_link.cli import LINK_ONLY, add_link_arguments, run_link
from .plot import write_sweep_plot
from .report import format_report, report_to_json
from .runner import run_benchmark
from .sizes import parse_size
from .workloads import WORKLOADS

__all__ = ["main"]

_DEFAULT_SWEEP = (0, 64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m distopt.benchmark",
        description="Step time of local (no communication), PyTorch DDP and distopt, "
        "interleaved in the same processes.",
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated subset of: " + ", ".join(WORKLOADS))
    p.add_argument("--world", type=int, default=2, help="processes (default 2); 1 runs only the world-size-1 section")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo; nccl runs on CUDA)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per mode (x5 for mlp; default 20)")
    p.add_argument("--rounds", type=int, default=10,
                   help="interleaving rounds the timed steps are spread over (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode after it is built (default 3)")
    p.add_argument("--thresholds", default="", help="extra distopt pack thresholds, comma-separated (e.g. 0,1M,64MiB)")
    p.add_argument("--sweep", metavar="PNG",
                   help="time distopt over a range of pack thresholds and plot step time against them")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the figures as JSON to PATH, or alone: print JSON instead of the table")
    p.add_argument("--modes", default="", metavar="NAMES",
                   help="optional modes to add, comma-separated: distopt+join (the cost of join() while ranks are "
                        "even), distopt+shard (shard_state=True), distopt-noinspect (the stall inspector off), "
                        "distopt-allreduce (small sums all-reduced, not gathered), distopt-local4 (local SGD, parameters averaged every 4th step), "
                        "distopt-stream4 (streaming local SGD: a quarter of the model each step, sync_overlap=1), "
                        "distopt-nodrift and distopt+drift1 (the drift check off, and at every step: together, what "
                        "the default check every 100 steps costs)")
    p.add_argument("--profile", metavar="WORKLOAD", choices=list(WORKLOADS),
                   help="instead of timing: profile local, ddp and distopt on one workload with torch.profiler and "
                        "print the ms per step of each phase and the top operators (rank 0)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes (one fresh launch per mode)")
    p.add_argument("--no-world1", action="store_true", help="skip the world-size-1 section")
    p.add_argument("--seed", type=int, default=0, help="seed of model initialisation and data (default 0)")
    add_link_arguments(p)
    return p


# The step-time benchmark's flags that mean nothing to the slow-link benchmark: dest -> flag.
_STEP_ONLY = {"workloads": "--workloads", "world": "--world", "backend": "--backend", "iters": "--iters",
              "rounds": "--rounds", "warmup": "--warmup", "thresholds": "--thresholds", "sweep": "--sweep",
              "modes": "--modes", "profile": "--profile", "no_memory": "--no-memory", "no_world1": "--no-world1"}


def _check_mode_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags of the other benchmark: they would be silently ignored otherwise."""
    if args.link is not None:
        given = [flag for dest, flag in _STEP_ONLY.items() if getattr(args, dest) != parser.get_default(dest)]
        if given:
            parser.error(f"{', '.join(given)} belong(s) to the step-time benchmark and mean nothing with --link; "
                         "the slow-link benchmark takes --tasks, --contenders, --powersgd-rank, --quick, --link-rounds, --plots")
    else:
        given = [flag for dest, flag in LINK_ONLY.items() if getattr(args, dest) not in (None, False)]
        if given:
            parser.error(f"{', '.join(given)} only go(es) with --link RATE (e.g. --link 200mbit)")


def _config_from_args(args: argparse.Namespace) -> BenchConfig:
    thresholds = [parse_size(t) for t in args.thresholds.split(",") if t.strip()]
    if args.sweep and not thresholds:
        thresholds = list(_DEFAULT_SWEEP)
    default = DEFAULT_PACK_THRESHOLD
    # The default mode already covers the default threshold.
    thresholds = sorted({t for t in thresholds if t != default})
    return BenchConfig(
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        world=args.world,
        backend=args.backend,
        iters=args.iters,
        rounds=args.rounds,
        warmup=args.warmup,
        thresholds=tuple(thresholds),
        extra_modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        memory=not args.no_memory,
        world1=not args.no_world1,
        seed=args.seed,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the process exit status.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
        0; 1 when ``--link`` cannot build its link here (not root, say), with a message saying
        what to do; bad flags exit through argparse with status 2 instead.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    _check_mode_flags(parser, args)
    if args.link is not None:
        return run_link(args, parser)
    try:
        cfg = _config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    if args.profile:
        from ..launching import launch
        from .profiling import format_profile, profile_worker

        figures = launch(profile_worker, cfg.world, args=(cfg, args.profile), backend=cfg.backend)[0]
        print(format_profile(args.profile, figures))
        return 0
    report = run_benchmark(cfg, log=lambda line: print(f"[benchmark] {line}", file=sys.stderr, flush=True))
    if args.json == "-":
        print(json.dumps(report_to_json(report), indent=2))
    else:
        print(format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report_to_json(report), f, indent=2)
    if args.sweep:
        write_sweep_plot(report, args.sweep)
        print(f"[benchmark] wrote {args.sweep}", file=sys.stderr)
    print(f"[benchmark] done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0
