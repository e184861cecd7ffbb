""":func:`~.runner.run_link_benchmark`'s figures as tables for people, or as plain JSON data.

One table per task. For every task: ms per step (the slowest rank's; median, and the
mean that time to a loss is made of), how that compares with ``local`` (the medians'
ratio, and the ratio paired by round: :meth:`~.results.TaskResult.paired_ratio`), and the MiB a
rank's interface sent per step. For the real task also: the target loss and how it
was chosen, the steps and training seconds each contender needed to reach it, that
time against its floor (the steps it needed at ``local``'s mean step time), and the
loss at the fixed step count, against the uncompressed contender of the same kind.
With ``island-alone`` in the run (``--ranks-per-host``), every table also gives each
contender's step against it, paired by round (``x alone``). A contender that did not
finish says why, in a note under its table.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .rates import format_rate
from .results import ALONE, ContenderRun, TaskResult, smoothed

__all__ = ["format_link_report", "link_report_to_json"]


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or not b else a / b


def _final_loss(run: ContenderRun, window: int) -> Optional[float]:
    return smoothed(run.losses, window)[-1] if run.losses and run.ok else None


def _status(run: ContenderRun, notes: List[str]) -> str:
    if run.ok:
        return "ok"
    done = f" (its figures are of the {len(run.step_ms)} steps it completed)" if run.step_ms else ""
    notes.append(f"  [{len(notes) + 1}] {run.name} {run.status}{done}: {run.reason}")
    return f"{run.status} [{len(notes)}]"


def _spread(run: ContenderRun) -> str:
    if len(run.step_ms) < 2:
        return "-"
    ordered = sorted(run.step_ms)
    q1, q3 = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
    return f"{q1:.0f}-{q3:.0f}"


def _step_table(task: TaskResult) -> List[str]:
    local = task.local_median_ms()
    notes: List[str] = []
    alone = ALONE in task.runs
    lines = [f"  {'contender':<22}{'median ms':>11}{'p25-p75 ms':>13}{'mean ms':>10}{'x local':>9}{'paired':>8}"
             f"{'x alone' if alone else '':>9}{'MiB sent/step':>15}  status"]
    for run in task.runs.values():
        lines.append(f"  {run.name:<22}{_fmt(run.median_ms, '.1f'):>11}{_spread(run):>13}"
                     f"{_fmt(run.mean_ms, '.1f'):>10}{_fmt(_ratio(run.median_ms, local), '.2f'):>9}"
                     f"{_fmt(task.paired_ratio(run.name), '.2f'):>8}"
                     f"{_fmt(task.paired_ratio(run.name, ALONE), '.2f') if alone else '':>9}"
                     f"{_fmt(run.sent_mib, '.2f'):>15}  {_status(run, notes)}")
    if alone:
        lines.append(f"  x alone: the mean step over {ALONE}'s (each island training alone), paired by round")
    return lines + notes


def _real_table(task: TaskResult) -> List[str]:
    target = task.target
    window = target.window if target is not None else max(3, task.schedule["steps"] // 20)
    local = task.local_mean_ms()
    finals = {name: (run.final_val() if run.final_val() is not None else _final_loss(run, window))
              for name, run in task.runs.items()}
    notes: List[str] = []
    lines = [f"  {target.describe()}" if target is not None
             else "  no target loss: neither ddp, distopt nor local ran every step"]
    alone = ALONE in task.runs
    lines.append(f"  {'contender':<22}{'mean ms':>9}{'x local':>9}{'x alone' if alone else '':>9}{'MiB/step':>10}"
                 f"{'steps to':>10}{'s to':>8}"
                 f"{'x floor':>9}{'final loss':>12}{'val loss':>10}{'vs uncompr.':>13}  status")
    for name, run in task.runs.items():
        steps = target.steps_to(run) if target is not None and run.ok else None
        seconds = target.seconds_to(run) if target is not None and run.ok else None
        floor = None if steps is None or local is None else steps * local / 1e3
        base = finals.get(run.baseline) if run.baseline else None
        delta = None if base is None or finals[name] is None else 100 * (finals[name] - base) / base
        lines.append(
            f"  {name:<22}{_fmt(run.mean_ms, '.1f'):>9}{_fmt(_ratio(run.mean_ms, local), '.2f'):>9}"
            f"{_fmt(task.paired_ratio(name, ALONE), '.2f') if alone else '':>9}{_fmt(run.sent_mib, '.2f'):>10}"
            f"{_fmt(steps, 'd') if run.ok else '-':>10}{_fmt(seconds, '.1f'):>8}"
            f"{_fmt(_ratio(seconds, floor), '.2f'):>9}{_fmt(_final_loss(run, window), '.4f'):>12}"
            f"{_fmt(run.final_val(), '.4f'):>10}{_fmt(delta, '+.2f') + ('%' if delta is not None else ''):>13}"
            f"  {_status(run, notes)}")
    lines.append(f"  steps to / s to: the first step at which the smoothed loss reached the target, and the training "
                 f"seconds until then ('-': not within {task.schedule['steps']} steps); x floor: those seconds over "
                 "the steps needed at local's mean step time; final loss: smoothed training loss after the last "
                 "step; val loss: on the held-out 10%; vs uncompr.: the final loss (val where measured) against "
                 "the same contender uncompressed")
    return lines + notes


def _schedule(schedule: Dict[str, int]) -> str:
    text = f"{schedule['rounds']} rounds of {schedule['chunk']} steps per contender, interleaved"
    if schedule["warmup"]:
        text = f"{schedule['warmup']} warm-up steps, then " + text
    if schedule["eval_every"]:
        text += f"; validation every {schedule['eval_every'] * schedule['chunk']} steps"
    return text


def _probe_line(link: Dict[str, Any]) -> str:
    probe = link["probe"]
    ceiling = link["rate_bps"] * 1448 / 1514 / 1e6
    return (f"link check (TCP, {link['probe_bytes'] / 2**20:.3g} MiB each way): a->b {probe['a_to_b']['mbit_s']:.1f}, "
            f"b->a {probe['b_to_a']['mbit_s']:.1f} Mbit/s of payload (the ceiling is {ceiling:.1f}: tbf counts "
            f"every frame's headers); round trip {probe['a_to_b']['rtt_ms']:.2f} ms")


def format_link_report(report: Dict[str, Any]) -> str:
    """The human-readable tables of :func:`~.runner.run_link_benchmark`'s figures.

    Args:
        report: what :func:`~.runner.run_link_benchmark` returned.

    Returns:
        The tables, lines joined by newlines, without a trailing newline.
    """
    cfg, env, link = report["config"], report["environment"], report["link"]
    cores: Sequence[int] = env["cores"]
    per_host = cfg.get("ranks_per_host", 1)
    ranks = (f"2 ranks, one per namespace, pinned to cores {cores[0]} and {cores[1]}" if per_host == 1 else
             f"{2 * per_host} ranks, {per_host} per namespace (loopback inside, the shaped link between), pinned to "
             f"cores {', '.join(map(str, cores))} ({2 * per_host} processes on {len(set(cores))} cores)")
    lines = [
        f"distopt slow-link benchmark: {format_rate(cfg['rate_bps'])} each way between two network namespaces "
        f"(veth pair; {link['tbf_text']} on both ends){'; --quick' if cfg['quick'] else ''}",
        f"{ranks}; gloo; torch {env['torch']}, Python "
        f"{env['python']}, {env['cpu']}, kernel {env['kernel']}; load average {env['load_before'][0]:.1f} before, "
        f"{env['load_after'][0]:.1f} after; {env['seconds']:.0f} s",
        _probe_line(link),
        "ms = the slowest rank's step; MiB sent = what one rank's veth sent per step, headers included"
        f"{'' if per_host == 1 else f' (a namespace sends for its {per_host} ranks: the count over {per_host})'}; "
        f"PowerSGD rank {cfg['powersgd_rank']}",
    ]
    for task in report["tasks"]:
        data = next((run.info["data"] for run in task.runs.values() if "data" in run.info), None)
        lines += ["", f"[{task.name}] {task.description}{f' ({data})' if data else ''}; {_schedule(task.schedule)}"]
        lines += _real_table(task) if task.real else _step_table(task)
    return "\n".join(lines)


def link_report_to_json(report: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`~.runner.run_link_benchmark`'s figures as plain JSON-serialisable data.

    Args:
        report: what :func:`~.runner.run_link_benchmark` returned.

    Returns:
        The same keys, each :class:`~.results.TaskResult` replaced by its ``to_json()``.
    """
    return {**{k: v for k, v in report.items() if k != "tasks"}, "tasks": [t.to_json() for t in report["tasks"]]}
