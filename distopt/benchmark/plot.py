"""The ``--sweep`` plot: distopt's step time against ``pack_threshold``, with references.

matplotlib is imported only when a plot is written, so the rest of the benchmark
runs without it.
"""
from __future__ import annotations

from typing import Any, Dict

from .mode_specs import split_mode_name
from .sizes import format_size

__all__ = ["write_sweep_plot"]


def _threshold(name: str, default: int) -> int:
    # Plain ``distopt`` runs at the optimizer's default threshold.
    variant = split_mode_name(name)[1]
    return default if variant is None else variant


def write_sweep_plot(report: Dict[str, Any], path: str) -> None:
    """Write a PNG of median step time against ``pack_threshold``, one panel per workload.

    The default distopt mode is placed at the optimizer's default threshold;
    ``local``, ``ddp`` and ``bare_allreduce`` are horizontal reference lines.

    Args:
        report: what :func:`~distopt.benchmark.run_benchmark` returned; the distributed
            section is plotted, or the world-size-1 section when there is none.
        path: where the PNG goes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["distributed"] or report["world1"]
    default = report["environment"]["distopt_default_pack_threshold"]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        points = sorted(
            (_threshold(name, default), mode.median_ms)
            for name, mode in result.modes.items()
            if name.startswith("distopt")
        )
        xs = list(range(len(points)))
        ax.plot(xs, [ms for _, ms in points], "o-", label="distopt")
        ax.set_xticks(xs)
        ax.set_xticklabels([format_size(t) for t, _ in points], rotation=45)
        for name, style in (("ddp", "r--"), ("local", "g:"), ("bare_allreduce", "k-.")):
            if name in result.modes:
                ax.axhline(result.modes[name].median_ms, linestyle=style[1:], color=style[0], label=name)
        ax.set_title(f"{result.name} (world {result.world})")
        ax.set_xlabel("pack_threshold")
        ax.set_ylabel("median step time (ms)")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
