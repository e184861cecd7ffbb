"""Side-by-side step-time benchmark: no communication, PyTorch DDP and distopt.

Run ``python -m distopt.benchmark --help`` for the flags. In one launch of
``--world`` processes, every workload builds one model copy and one optimizer
per mode, warms each up, then times them in interleaved rounds (each round runs
a few steps of every mode in turn, in a rotated order) so that machine noise
hits all modes alike. Modes:

* ``local``: the bare inner optimizer, no communication. The floor.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults.
* ``distopt``: :class:`distopt.DistributedOptimizer` with its defaults, and
  ``distopt@<size>`` for every ``--thresholds`` / ``--sweep`` pack threshold.
* ``bare_allreduce``: one all-reduce of a flat buffer as large as all gradients
  together, no compute: the cost of the communication alone.

Every model mode uses the same seed, the same per-rank batch, the same inner
optimizer (SGD with momentum) and ``zero_grad(set_to_none=True)``. A step's
time is the slowest rank's; the report gives the median over all timed steps.

Peak memory is measured for ``local``, ``ddp`` and ``distopt`` in a fresh
launch per (workload, mode); :mod:`distopt.benchmark.memory` says how.

A world-size-1 section compares the wrapper with no process group against the
bare inner optimizer in this process.

The package, a plain import DAG:

* :mod:`.sizes`: ``parse_size`` / ``format_size``.
* :mod:`.workloads`: the models, by name (:data:`WORKLOADS`).
* :mod:`.mode_specs`: the modes, by name (``MODES``), and how each wraps a replica.
* :mod:`.config`: :class:`BenchConfig`.
* :mod:`.results`: :class:`ModeResult`, :class:`WorkloadResult`.
* :mod:`.process`: per-process setup shared by modes, timing and memory probes.
* :mod:`.modes`: which modes a run runs, and how each is built and stepped.
* :mod:`.timing`: interleaved timing and all-reduce counts, per rank and merged.
* :mod:`.memory`: the peak-memory probe.
* :mod:`.runner`: :func:`run_benchmark`, every section.
* :mod:`.report`: the table and the JSON; :mod:`.plot`: the ``--sweep`` PNG.
* :mod:`.cli`: :func:`main`, the command line.
* :mod:`.link`: ``--link RATE``, the slow-link benchmark: two shaped network namespaces,
  DDP's comm hooks against distopt's compressors, time to a target loss on a real task.
"""
from .cli import main
from .config import BenchConfig
from .plot import write_sweep_plot
from .report import format_report, report_to_json
from .results import ModeResult, WorkloadResult
from .runner import run_benchmark
from .sizes import format_size, parse_size
from .workloads import WORKLOADS

__all__ = [
    "BenchConfig",
    "ModeResult",
    "WorkloadResult",
    "WORKLOADS",
    "parse_size",
    "format_size",
    "run_benchmark",
    "format_report",
    "report_to_json",
    "write_sweep_plot",
    "main",
]
