"""The slow-link benchmark's plots: loss against training time, and bytes sent per step, per task.

Two PNGs per task, named after the link and the task (``link-200mbit-charlm-loss.png``,
``link-200mbit-charlm-bytes.png``):

* loss against each contender's own training seconds (smoothed as the target is),
  the target as a horizontal line and validation losses as markers: which
  contender gets low soonest;
* MiB each rank's interface sent at each step: synchronous training sends every
  step, local SGD in bursts every 4th, which later streaming work will smooth.

matplotlib is imported only here, when plots are asked for (``--plots DIR``);
:func:`require_matplotlib` says clearly when it is missing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from .rates import rate_slug
from .results import TaskResult, smoothed

__all__ = ["require_matplotlib", "write_link_plots"]


def require_matplotlib() -> None:
    """Raise ImportError with the fix unless matplotlib can be imported.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("--plots needs matplotlib, which is not installed: `pip install matplotlib` (it is in "
                          "distopt's test and examples extras), or leave out --plots") from None


def _style(name: str, color: Any) -> Dict[str, Any]:
    # DDP dashed, local dotted black, distopt solid: the families tell apart at a glance.
    if name == "local":
        return {"linestyle": ":", "color": "black"}
    return {"linestyle": "--" if name.startswith("ddp") else "-", "color": color}


def _loss_plot(task: TaskResult, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    window = task.target.window if task.target is not None else max(3, task.schedule["steps"] // 20)
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
    cmap = plt.get_cmap("tab20")
    for i, run in enumerate(task.runs.values()):
        if not run.losses:
            continue
        style = _style(run.name, cmap(i % 20))
        label = run.name if run.ok else f"{run.name} ({run.status})"
        losses = smoothed(run.losses, window)
        times, steps = run.elapsed_s(), range(1, len(losses) + 1)
        by_time.plot(times, losses, label=label, **style)
        by_step.plot(steps, losses, label=label, **style)
        for step, val in run.evals:
            by_time.plot(times[step - 1], val, "o", color=style["color"], markersize=4)
            by_step.plot(step, val, "o", color=style["color"], markersize=4)
    for ax in (by_time, by_step):
        if task.target is not None:
            ax.axhline(task.target.loss, color="grey", linewidth=0.8, label=f"target {task.target.loss:.3f}")
    by_time.set_xlabel("training seconds (each contender's own steps)")
    by_step.set_xlabel("step")
    by_time.set_ylabel(f"training loss, trailing mean of {window} steps (dots: validation)")
    by_time.set_title(f"{title}: against time")
    by_step.set_title("against steps (the same data at every step)")
    by_step.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bytes_plot(task: TaskResult, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    runs = [run for run in task.runs.values() if run.sent_bytes]
    cols = 3
    rows = max(1, -(-len(runs) // cols))
    # One small panel per contender, each with its own scale: 0.1 and 12 MiB a step on one axis would
    # hide the shape (every step, or bursts every 4th) that streaming work is about.
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 1.8 * rows), sharex=True, squeeze=False)
    for ax, run in zip(axes.flat, runs):
        ax.bar(range(1, len(run.sent_bytes) + 1), [b / 2**20 for b in run.sent_bytes], width=1.0,
               color="black" if run.name == "local" else ("tab:orange" if run.name.startswith("ddp") else "tab:blue"))
        ax.set_title(f"{run.name}: {run.sent_mib:.2f} MiB/step", fontsize="small")
        ax.tick_params(labelsize="x-small")
    for ax in list(axes.flat)[len(runs):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: MiB one rank's interface sent at each recorded step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_link_plots(report: Dict[str, Any], directory: str) -> List[str]:
    """Write the loss and bytes plots of every task into ``directory`` (made if missing).

    Args:
        report: what :func:`~.runner.run_link_benchmark` returned.
        directory: where the PNGs go.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    slug = rate_slug(report["config"]["rate_bps"])
    written = []
    for task in report["tasks"]:
        for kind, draw in (("loss", _loss_plot), ("bytes", _bytes_plot)):
            path = out / f"link-{slug}-{task.name}-{kind}.png"
            draw(task, path, f"{task.name} over a {slug} link: {kind}")
            written.append(str(path))
    return written
