"""``python -m distopt.benchmark --link RATE``: the slow-link flags, and the run from flags to tables.

The flags join the benchmark's own parser (:mod:`distopt.benchmark.cli`); those of the
step-time benchmark that mean nothing here (``--workloads``, ``--world``, ...) are
refused with ``--link``, and these are refused without it.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, List

from .config import LinkConfig
from .contenders import CONTENDERS, ContenderOptions
from .namespaces import LinkUnavailableError
from .plot import require_matplotlib, write_link_plots
from .rates import parse_rate
from .report import format_link_report, link_report_to_json
from .runner import run_link_benchmark
from .supervisor import HostError
from .tasks import TASKS

__all__ = ["add_link_arguments", "LINK_ONLY", "run_link"]

#: The destinations of the flags that only ``--link`` takes, with their flag names.
LINK_ONLY = {"tasks": "--tasks", "contenders": "--contenders", "powersgd_rank": "--powersgd-rank",
             "quick": "--quick", "link_rounds": "--link-rounds", "plots": "--plots",
             "ranks_per_host": "--ranks-per-host"}


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--link`` and the flags that go with it to the benchmark's parser.

    Args:
        parser: the benchmark's parser.
    """
    group = parser.add_argument_group(
        "slow link (--link)",
        "two network namespaces joined by a veth pair shaped with tc tbf, one rank in each (or --ranks-per-host), "
        "each pinned to a core; needs root")
    group.add_argument("--link", metavar="RATE",
                       help="run the slow-link benchmark over a link of RATE each way: e.g. 100mbit, 200mbit, 1gbit "
                            "(units kbit, mbit, gbit)")
    group.add_argument("--tasks", metavar="NAMES",
                       help="comma-separated subset of: " + ", ".join(TASKS) + " (default: all)")
    group.add_argument("--contenders", metavar="NAMES",
                       help="comma-separated subset of: " + ", ".join(CONTENDERS) + " (default: all)")
    group.add_argument("--powersgd-rank", type=int, metavar="R",
                       help="rank of DDP's PowerSGD hook and of distopt's PowerSGD (default 4)")
    group.add_argument("--quick", action="store_true",
                       help="a few steps per task instead of the full schedule: a check that it runs, not figures")
    group.add_argument("--link-rounds", type=int, metavar="N",
                       help="interleaved rounds per task instead of its schedule's (3 of 8 steps for the 12 MiB "
                            "models, 8 of 16 for charlm): more rounds, a steadier mean step")
    group.add_argument("--ranks-per-host", type=int, metavar="K",
                       help="K ranks in each namespace, loopback between them and the shaped link between the two "
                            "hosts (default 1); with 2 or more the default contenders are the flat ones to beat and "
                            "the two-level ones: island-alone, hsdp, islands, islands-int8, islands-diloco16, "
                            "islands-stream16")
    group.add_argument("--plots", metavar="DIR",
                       help="write loss-against-time and bytes-per-step PNGs per task into DIR (needs matplotlib)")


def _names(text: str) -> tuple:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _config(args: argparse.Namespace) -> LinkConfig:
    kwargs = {}
    if args.tasks is not None:
        kwargs["tasks"] = _names(args.tasks)
    if args.contenders is not None:
        kwargs["contenders"] = _names(args.contenders)
    if args.ranks_per_host is not None:
        kwargs["ranks_per_host"] = args.ranks_per_host
    options = ContenderOptions() if args.powersgd_rank is None else ContenderOptions(powersgd_rank=args.powersgd_rank)
    return LinkConfig(rate_bps=parse_rate(args.link), options=options, quick=args.quick, seed=args.seed,
                      rounds=args.link_rounds, **kwargs)


def run_link(args: argparse.Namespace, parser: argparse.ArgumentParser,
             log: Callable[[str], None] = lambda line: print(f"[benchmark --link] {line}", file=sys.stderr,
                                                             flush=True)) -> int:
    """Run the slow-link benchmark from parsed flags; print the tables (or JSON) and write the plots.

    Args:
        args: the benchmark's parsed flags, ``args.link`` set.
        parser: for usage errors (bad values exit with status 2).
        log: receives progress lines.

    Returns:
        0; 1 when the link cannot be built here (not root, no ``ip``/``tc``), with a
        message on stderr saying what to do; 130 after Ctrl-C.
    """
    try:
        cfg = _config(args)
        if args.plots:
            require_matplotlib()
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    try:
        report = run_link_benchmark(cfg, log=log)
    except (LinkUnavailableError, HostError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # run_link_benchmark has ended its processes and removed the namespaces on the way out.
        print(f"{parser.prog}: interrupted; the link and every process it started are removed", file=sys.stderr)
        return 130
    if args.json == "-":
        print(json.dumps(link_report_to_json(report), indent=2))
    else:
        print(format_link_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(link_report_to_json(report), f, indent=2)
    if args.plots:
        written: List[str] = write_link_plots(report, args.plots)
        log(f"wrote {', '.join(written)}")
    return 0
