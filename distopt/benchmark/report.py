""":func:`~distopt.benchmark.run_benchmark`'s figures as a table for people or as plain JSON data."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..wrapper.drift_check import DEFAULT_CHECK_EVERY
from .mode_specs import display_name
from .results import WorkloadResult
from .sizes import format_size

__all__ = ["format_report", "report_to_json"]


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_overhead(result: WorkloadResult) -> str:
    if result.overhead is not None:
        return f"{result.overhead:.3f}"
    return "n/a (ddp within 5% of local)" if result.ratio is not None else "-"


def _fmt_mib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _mode_table(result: WorkloadResult) -> List[str]:
    header = f"{'median ms':>11}{'p25-p75 ms':>17}{'calls/step':>16}{'MiB sent':>13}{'peak mem MiB':>14}"
    lines = [f"  {'mode':<18}{header}"]
    for mode in result.modes.values():
        spread = f"{mode.p25_ms:.2f}-{mode.p75_ms:.2f}"
        calls = "-" if mode.allreduce_calls is None else f"{mode.allreduce_calls:g}"
        lines.append(
            f"  {display_name(mode.name):<18}{mode.median_ms:>11.2f}{spread:>17}{calls:>16}"
            f"{_fmt_mib(mode.reduced_bytes):>13}{_fmt_mib(mode.peak_mem_bytes):>14}"
        )
    return lines


def _drift_cost(result: WorkloadResult) -> List[str]:
    """One check's cost (a check at every step against none), and that at the default period as a share
    of a step: nothing unless both drift modes ran."""
    every, never, step = (result.median(n) for n in ("distopt+drift1", "distopt-nodrift", "distopt"))
    if every is None or never is None or not step:
        return []
    check = every - never
    return [f"  drift check: {check:.2f} ms a check (distopt+drift1 - distopt-nodrift); every {DEFAULT_CHECK_EVERY} "
            f"steps (the default) {check / DEFAULT_CHECK_EVERY:.3f} ms a step = "
            f"{100 * check / DEFAULT_CHECK_EVERY / step:.2f}% of a distopt step"]


def format_report(report: Dict[str, Any]) -> str:
    """The human-readable table of :func:`run_benchmark`'s figures.

    Args:
        report: what :func:`~distopt.benchmark.run_benchmark` returned.

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """
    cfg, env = report["config"], report["environment"]
    threshold = env["distopt_default_pack_threshold"]
    lines = [
        f"distopt benchmark: world={cfg['world']} backend={cfg['backend']} device={env['device']} "
        f"torch={env['torch']} cores={env['cpu_cores']} iters={cfg['iters']} rounds={cfg['rounds']}",
        f"distopt default pack_threshold={'-' if threshold is None else format_size(threshold)}; "
        "step time = slowest rank, median over timed steps",
    ]
    for result in report["distributed"]:
        bare = result.median("bare_allreduce")
        lines += [
            "",
            f"[{result.name}] {result.description}; {result.num_params} params, "
            f"{result.grad_bytes / 2**20:.1f} MiB of gradients, world {result.world}",
            *_mode_table(result),
            f"  ratio distopt/ddp = {_fmt(result.ratio, '.3f')}   "
            f"overhead (distopt-local)/(ddp-local) = {_fmt_overhead(result)}   "
            f"bare_allreduce floor = {_fmt(bare, '.2f')} ms",
        ]
        lines += _drift_cost(result)
    if report["world1"]:
        lines += ["", "[world size 1] DistributedOptimizer without a process group vs the bare inner optimizer"]
        lines.append(f"  {'workload':<14}{'local ms':>11}{'distopt ms':>12}{'distopt/local':>15}")
        for result in report["world1"]:
            loc, d = result.median("local"), result.median("distopt")
            ratio = None if loc is None or d is None or not loc else d / loc
            lines.append(f"  {result.name:<14}{_fmt(loc, '.2f'):>11}{_fmt(d, '.2f'):>12}{_fmt(ratio, '.3f'):>15}")
    return "\n".join(lines)


def report_to_json(report: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`run_benchmark`'s figures as plain JSON-serialisable data (adds ``ratio``, ``overhead``).

    Args:
        report: what :func:`~distopt.benchmark.run_benchmark` returned.

    Returns:
        The same keys, each :class:`WorkloadResult` replaced by its ``to_json()``.
    """
    return {
        "config": report["config"],
        "environment": report["environment"],
        "distributed": [r.to_json() for r in report["distributed"]],
        "world1": [r.to_json() for r in report["world1"]],
    }
