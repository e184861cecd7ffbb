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
launch per (workload, mode): on CUDA the growth of
``torch.cuda.max_memory_allocated``, on CPU the growth of the process's peak
resident set size (Linux ``VmHWM``, reset just before the mode is built) from
just before the mode is built through its warm-up steps. It therefore counts
parameters, gradients, optimizer state, communication buffers, activations and
allocator slack, and reports the largest figure over the ranks.

A world-size-1 section compares the wrapper with no process group against the
bare inner optimizer in this process.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from .launching import launch
from .optimizer import DEFAULT_PACK_THRESHOLD, DistributedOptimizer

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

Batch = Tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kb": 2**10, "kib": 2**10,
    "m": 2**20, "mb": 2**20, "mib": 2**20,
    "g": 2**30, "gb": 2**30, "gib": 2**30,
}
_DEFAULT_SWEEP = (0, 64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)
_MEMORY_MODES = ("local", "ddp", "distopt")
# Below this share of the floor, DDP's cost over ``local`` is within timing noise and
# ``overhead`` (a ratio of two such differences) would be noise too.
_MIN_COMM_SHARE = 0.05


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Workload:
    """A model, a fixed per-rank batch and a loss; ``iters_scale`` multiplies ``--iters``."""

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]
    loss_fn: LossFn
    iters_scale: int = 1


def _mlp_model() -> nn.Module:
    # 50 tiny Linear layers: 100 parameters of at most 4 KiB, so per-parameter hook and
    # launch overhead dominates, not bandwidth.
    layers: List[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers)


def _mlp_batch(gen: torch.Generator) -> Batch:
    return torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)


def _wide_model() -> nn.Module:
    # 4 parameters, ~128 MiB of fp32 gradients: copies and bandwidth dominate.
    return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))


def _wide_batch(gen: torch.Generator) -> Batch:
    return torch.randn(8, 4096, generator=gen), torch.randn(8, 4096, generator=gen)


class _TransformerModel(nn.Module):
    """A 4-layer ``nn.TransformerEncoder`` with a linear head: a realistic mix of sizes."""

    def __init__(self, d_model: int = 128, nhead: int = 4, layers: int = 4) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x))


def _transformer_batch(gen: torch.Generator) -> Batch:
    return torch.randn(8, 32, 128, generator=gen), torch.randn(8, 32, 128, generator=gen)


WORKLOADS: Dict[str, _Workload] = {
    w.name: w
    for w in (
        _Workload("mlp", "50 x Linear(32,32)", _mlp_model, _mlp_batch, nn.functional.mse_loss,
                  iters_scale=5),
        _Workload("wide", "2 x Linear(4096,4096)", _wide_model, _wide_batch, nn.functional.mse_loss),
        _Workload("transformer", "4-layer TransformerEncoder d=128", _TransformerModel, _transformer_batch,
                  nn.functional.mse_loss),
    )
}


# ---------------------------------------------------------------------------
# Configuration and results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run does.

    Attributes:
        workloads: names from :data:`WORKLOADS`, in run order.
        world: number of processes; 1 runs only the world-size-1 section.
        backend: torch.distributed backend; ``nccl`` runs on CUDA, others on CPU.
        iters: timed steps per mode (times each workload's ``iters_scale``), rounded
            up to a multiple of ``rounds``.
        rounds: interleaving rounds the timed steps are spread over.
        warmup: untimed steps per mode after it is built.
        thresholds: extra distopt pack thresholds in bytes, one mode each.
        memory: whether to probe peak memory (one fresh launch per mode).
        world1: whether to run the world-size-1 section.
        seed: seeds model initialisation and data.
        lr: SGD learning rate.
    """

    workloads: Tuple[str, ...] = ("mlp", "wide", "transformer")
    world: int = 2
    backend: str = "gloo"
    iters: int = 20
    rounds: int = 10
    warmup: int = 3
    thresholds: Tuple[int, ...] = ()
    memory: bool = True
    world1: bool = True
    seed: int = 0
    lr: float = 1e-4

    def __post_init__(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown:
            raise ValueError(f"workloads={unknown!r} are unknown; choose from {sorted(WORKLOADS)}")
        for name in ("world", "iters", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be at least 1")
        if self.warmup < 1:
            # DDP rebuilds its buckets after the first step; that step must not be timed.
            raise ValueError(f"warmup={self.warmup!r} must be at least 1")
        bad = [t for t in self.thresholds if t < 0]
        if bad:
            raise ValueError(f"thresholds={bad!r} must be non-negative byte counts")

    @property
    def device_type(self) -> str:
        """``"cuda"`` for NCCL, else ``"cpu"``."""
        return "cuda" if self.backend == "nccl" else "cpu"


@dataclass
class ModeResult:
    """Figures for one mode of one workload.

    Attributes:
        name: ``local``, ``ddp``, ``distopt``, ``distopt@<size>`` or ``bare_allreduce``.
        median_ms: median step time (slowest rank per step), milliseconds.
        p25_ms: 25th percentile step time.
        p75_ms: 75th percentile step time.
        allreduce_calls: all-reduce calls per step (None when not measured).
        reduced_bytes: bytes all-reduced per step (None when not measured).
        peak_mem_bytes: peak memory growth of the mode (None when not probed).
        times_ms: every timed step, for ``--json`` consumers.
    """

    name: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    allreduce_calls: Optional[int] = None
    reduced_bytes: Optional[int] = None
    peak_mem_bytes: Optional[int] = None
    times_ms: List[float] = field(default_factory=list)


@dataclass
class WorkloadResult:
    """Figures for one workload.

    Attributes:
        name: workload name.
        description: what the model is.
        world: processes the modes ran on (1 for the world-size-1 section).
        num_params: parameter tensors.
        grad_bytes: bytes of all gradients of one replica.
        modes: results per mode, in run order.
    """

    name: str
    description: str
    world: int
    num_params: int
    grad_bytes: int
    modes: Dict[str, ModeResult]

    def median(self, mode: str) -> Optional[float]:
        """Median step time of ``mode`` in ms, or None if it did not run."""
        return self.modes[mode].median_ms if mode in self.modes else None

    @property
    def ratio(self) -> Optional[float]:
        """``distopt / ddp`` median step time; below 1 means distopt is faster."""
        d, p = self.median("distopt"), self.median("ddp")
        return None if d is None or not p else d / p

    @property
    def overhead(self) -> Optional[float]:
        """``(distopt - local) / (ddp - local)``: distopt's communication cost relative to DDP's.

        None when DDP costs less than 5% over ``local``: the ratio would be noise.
        """
        d, p, loc = self.median("distopt"), self.median("ddp"), self.median("local")
        if d is None or p is None or loc is None or p - loc <= _MIN_COMM_SHARE * loc:
            return None
        return (d - loc) / (p - loc)

    def to_json(self) -> Dict[str, Any]:
        """The fields as plain data, plus ``ratio`` and ``overhead``."""
        out = asdict(self)
        out["ratio"] = self.ratio
        out["overhead"] = self.overhead
        return out


# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Parse a byte count such as ``0``, ``65536``, ``256K``, ``1MiB`` or ``25MB`` (binary units).

    Raises:
        ValueError: if ``text`` is not a non-negative number with an optional unit.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"size={text!r} is not a byte count; write e.g. 0, 65536, 256K, 1MiB or 25MB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(nbytes: int) -> str:
    """``1048576 -> '1MiB'``; exact binary multiples print without decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


# ---------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------


@dataclass
class _Mode:
    """One timed thing: ``run_step`` runs one step; ``stats_source`` is the distopt optimizer, if any."""

    name: str
    run_step: Callable[[], None]
    stats_source: Optional[DistributedOptimizer] = None


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # the launcher picked it
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh_model(workload: _Workload, seed: int, device: torch.device) -> nn.Module:
    # Same seed for every mode and rank: identical replicas without a broadcast.
    torch.manual_seed(seed)
    return workload.build_model().to(device)


def _train_step_fn(
    name: str, model: nn.Module, optimizer: Any, batch: Batch, loss_fn: LossFn, device: torch.device
) -> Callable[[], None]:
    x, y = batch

    def run_step() -> None:
        with record_function(f"bench/{name}/forward"):
            loss = loss_fn(model(x), y)
        with record_function(f"bench/{name}/backward"):
            loss.backward()
        with record_function(f"bench/{name}/step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)

    return run_step


def _build_mode(name: str, workload: _Workload, cfg: BenchConfig, batch: Batch, device: torch.device) -> _Mode:
    """Build the model copy and optimizer of mode ``name`` (``distopt@<bytes>`` picks a threshold)."""
    with record_function(f"bench/{name}/build"):
        model = _fresh_model(workload, cfg.seed, device)
        sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        if name == "local":
            return _Mode(name, _train_step_fn(name, model, sgd, batch, workload.loss_fn, device))
        if name == "ddp":
            device_ids = [device.index] if device.type == "cuda" else None
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
            return _Mode(name, _train_step_fn(name, ddp, sgd, batch, workload.loss_fn, device))
        if name == "distopt" or name.startswith("distopt@"):
            kwargs = {} if name == "distopt" else {"pack_threshold": int(name.split("@", 1)[1])}
            opt = DistributedOptimizer(sgd, **kwargs)
            return _Mode(name, _train_step_fn(name, model, opt, batch, workload.loss_fn, device), stats_source=opt)
    raise ValueError(f"mode={name!r} is unknown; use local, ddp, distopt or distopt@<bytes>")


def _bare_allreduce_mode(grad_numel: int, dtype: torch.dtype, device: torch.device) -> _Mode:
    flat = torch.zeros(grad_numel, dtype=dtype, device=device)

    def run_step() -> None:
        with record_function("bench/bare_allreduce"):
            dist.all_reduce(flat)
        _sync(device)

    return _Mode("bare_allreduce", run_step)


def _mode_names(cfg: BenchConfig, distributed: bool) -> List[str]:
    names = ["local", "ddp", "distopt"] if distributed else ["local", "distopt"]
    names += [f"distopt@{t}" for t in cfg.thresholds]
    return names


def _display_name(name: str) -> str:
    if name.startswith("distopt@"):
        return "distopt@" + format_size(int(name.split("@", 1)[1]))
    return name


# ---------------------------------------------------------------------------
# Counting and memory probes
# ---------------------------------------------------------------------------


def _counting_allreduce_hook(counter: List[int]) -> Callable[..., Any]:
    """A DDP comm hook that counts buckets, then does exactly DDP's default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # Left unannotated: DDP checks the hook's annotations at runtime, and this
    # module's postponed (string) annotations would fail that check.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        counter[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def _count_ddp_allreduces(workload: _Workload, cfg: BenchConfig, batch: Batch, device: torch.device) -> int:
    """All-reduce calls per DDP step, on a throwaway replica so the timed one keeps DDP's built-in path."""
    model = _fresh_model(workload, cfg.seed, device)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    counter = [0]
    ddp.register_comm_hook(None, _counting_allreduce_hook(counter))
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    step = _train_step_fn("ddp_count", ddp, sgd, batch, workload.loss_fn, device)
    for _ in range(max(2, cfg.warmup)):  # past DDP's bucket rebuild
        step()
    counter[0] = 0
    step()
    return counter[0]


def _distopt_counts(opt: DistributedOptimizer) -> Tuple[int, int]:
    """``(all-reduce calls, bytes on the wire)`` of the optimizer's last step."""
    return opt.stats.packs, opt.stats.bytes


def _current_rss() -> Optional[int]:
    """Resident set size in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux only); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        # ru_maxrss is KiB on Linux, bytes on macOS.
        scale = 1 if sys.platform == "darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    except ImportError:
        return None


def _warm_process(device: torch.device) -> None:
    """One step of a tiny model, so one-time costs (autograd engine, kernel libraries; ~80 MiB
    of RSS on CPU) land before the baseline and are not charged to whichever mode is probed."""
    model = nn.Linear(4, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del model, opt
    gc.collect()


def _memory_worker(cfg: BenchConfig, workload_name: str, mode_name: str) -> Optional[int]:
    """In a fresh process: peak memory growth from building mode ``mode_name`` through its warm-up."""
    _worker_setup(cfg)
    device = _device()
    workload = WORKLOADS[workload_name]
    batch = _make_batch(workload, cfg, device)
    _warm_process(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before: Optional[int] = torch.cuda.memory_allocated(device)
    else:
        _reset_peak_rss()
        before = _current_rss()
    mode = _build_mode(mode_name, workload, cfg, batch, device)
    for _ in range(cfg.warmup):
        mode.run_step()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss()
    if dist.is_initialized():
        dist.barrier()
    if before is None or peak is None:
        return None
    return max(0, peak - before)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def _worker_setup(cfg: BenchConfig) -> None:
    # Processes share the cores: one process per core is the fair layout for every mode.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // cfg.world))


def _make_batch(workload: _Workload, cfg: BenchConfig, device: torch.device) -> Batch:
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    x, y = workload.make_batch(gen)
    return x.to(device), y.to(device)


def _time_interleaved(modes: Sequence[_Mode], steps: int, rounds: int, distributed: bool) -> Dict[str, List[float]]:
    """Seconds of every timed step per mode; each round runs ``steps`` of each mode, order rotated."""
    times: Dict[str, List[float]] = {m.name: [] for m in modes}
    for r in range(rounds):
        shift = r % len(modes)
        for mode in list(modes[shift:]) + list(modes[:shift]):
            if distributed:
                dist.barrier()  # every rank starts the mode together
            for _ in range(steps):
                start = time.perf_counter()
                mode.run_step()
                times[mode.name].append(time.perf_counter() - start)
    return times


def _workload_raw(cfg: BenchConfig, workload: _Workload, distributed: bool) -> Dict[str, Any]:
    """Build, warm up and time every mode of one workload in this process; rank-local figures."""
    device = _device()
    batch = _make_batch(workload, cfg, device)
    probe = _fresh_model(workload, cfg.seed, device)
    params = [p for p in probe.parameters() if p.requires_grad]
    grad_numel = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    dtype = params[0].dtype
    del probe, params

    counts: Dict[str, Tuple[Optional[int], Optional[int]]] = {"local": (0, 0)}
    if distributed:
        counts["ddp"] = (_count_ddp_allreduces(workload, cfg, batch, device), grad_bytes)
        counts["bare_allreduce"] = (1, grad_bytes)
        gc.collect()

    modes = [_build_mode(name, workload, cfg, batch, device) for name in _mode_names(cfg, distributed)]
    if distributed:
        modes.append(_bare_allreduce_mode(grad_numel, dtype, device))
    for mode in modes:
        for _ in range(cfg.warmup):
            mode.run_step()
        if mode.stats_source is not None:
            counts[mode.name] = _distopt_counts(mode.stats_source)

    steps = max(1, math.ceil(cfg.iters * workload.iters_scale / cfg.rounds))
    times = _time_interleaved(modes, steps, cfg.rounds, distributed)
    del modes
    gc.collect()
    return {
        "name": workload.name,
        "num_params": _param_count(workload),
        "grad_bytes": grad_bytes,
        "counts": counts,
        "times": times,
    }


def _param_count(workload: _Workload) -> int:
    with torch.device("meta"):
        return sum(1 for p in workload.build_model().parameters() if p.requires_grad)


def _bench_worker(cfg: BenchConfig) -> List[Dict[str, Any]]:
    """Entry point of every rank: all workloads, one after another."""
    _worker_setup(cfg)
    return [_workload_raw(cfg, WORKLOADS[name], distributed=True) for name in cfg.workloads]


def _summarise(raw_by_rank: Sequence[Dict[str, Any]], world: int) -> WorkloadResult:
    """Merge ranks: a step takes as long as its slowest rank; then percentiles per mode."""
    first = raw_by_rank[0]
    modes: Dict[str, ModeResult] = {}
    for name, times0 in first["times"].items():
        per_step = [max(raw["times"][name][i] for raw in raw_by_rank) * 1e3 for i in range(len(times0))]
        q = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [per_step[0]] * 3
        calls, nbytes = first["counts"].get(name, (None, None))
        modes[name] = ModeResult(name, statistics.median(per_step), q[0], q[2], calls, nbytes, None, per_step)
    workload = WORKLOADS[first["name"]]
    return WorkloadResult(first["name"], workload.description, world, first["num_params"], first["grad_bytes"], modes)


# ---------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------


def _launch(fn: Callable[..., Any], cfg: BenchConfig, args: Tuple[Any, ...]) -> List[Any]:
    return launch(fn, nprocs=cfg.world, args=args, backend=cfg.backend)


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Run every section of the benchmark and return its figures.

    Args:
        cfg: what to run.
        log: receives one line per phase (progress for humans).

    Returns:
        ``{"config", "environment", "distributed": [WorkloadResult], "world1": [WorkloadResult]}``.
    """
    distributed: List[WorkloadResult] = []
    if cfg.world > 1:
        log(f"timing {', '.join(cfg.workloads)} on {cfg.world} processes ({cfg.backend})")
        per_rank = _launch(_bench_worker, cfg, (cfg,))
        distributed = [_summarise([rank[i] for rank in per_rank], cfg.world) for i in range(len(cfg.workloads))]
        if cfg.memory:
            for result in distributed:
                for mode in _MEMORY_MODES:
                    if mode in result.modes:
                        log(f"memory probe: {result.name}/{mode} in a fresh launch")
                        peaks = _launch(_memory_worker, cfg, (cfg, result.name, mode))
                        known = [p for p in peaks if p is not None]
                        result.modes[mode].peak_mem_bytes = max(known) if known else None
    world1: List[WorkloadResult] = []
    if cfg.world1 or cfg.world == 1:
        log("world-size-1: wrapper without a process group vs the bare optimizer, in this process")
        world1 = _world1_section(cfg)
    return {
        "config": asdict(cfg),
        "environment": _environment(cfg),
        "distributed": distributed,
        "world1": world1,
    }


def _world1_section(cfg: BenchConfig) -> List[WorkloadResult]:
    if dist.is_initialized():
        raise RuntimeError("the world-size-1 section needs a process without a process group; run it outside torchrun")
    one = replace(cfg, world=1)
    _worker_setup(one)
    return [_summarise([_workload_raw(one, WORKLOADS[name], distributed=False)], 1) for name in cfg.workloads]


def _environment(cfg: BenchConfig) -> Dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_cores": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if cfg.device_type == "cuda" and torch.cuda.is_available() else "cpu",
        "distopt_default_pack_threshold": DEFAULT_PACK_THRESHOLD,
    }


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_overhead(result: WorkloadResult) -> str:
    if result.overhead is not None:
        return f"{result.overhead:.3f}"
    return "n/a (ddp within 5% of local)" if result.ratio is not None else "-"


def _fmt_mib(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _mode_table(result: WorkloadResult) -> List[str]:
    header = f"{'median ms':>11}{'p25-p75 ms':>17}{'allreduce/step':>16}{'MiB reduced':>13}{'peak mem MiB':>14}"
    lines = [f"  {'mode':<18}{header}"]
    for mode in result.modes.values():
        spread = f"{mode.p25_ms:.2f}-{mode.p75_ms:.2f}"
        calls = "-" if mode.allreduce_calls is None else str(mode.allreduce_calls)
        lines.append(
            f"  {_display_name(mode.name):<18}{mode.median_ms:>11.2f}{spread:>17}{calls:>16}"
            f"{_fmt_mib(mode.reduced_bytes):>13}{_fmt_mib(mode.peak_mem_bytes):>14}"
        )
    return lines


def format_report(report: Dict[str, Any]) -> str:
    """The human-readable table of :func:`run_benchmark`'s figures."""
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
    if report["world1"]:
        lines += ["", "[world size 1] DistributedOptimizer without a process group vs the bare inner optimizer"]
        lines.append(f"  {'workload':<14}{'local ms':>11}{'distopt ms':>12}{'distopt/local':>15}")
        for result in report["world1"]:
            loc, d = result.median("local"), result.median("distopt")
            ratio = None if loc is None or d is None or not loc else d / loc
            lines.append(f"  {result.name:<14}{_fmt(loc, '.2f'):>11}{_fmt(d, '.2f'):>12}{_fmt(ratio, '.3f'):>15}")
    return "\n".join(lines)


def report_to_json(report: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`run_benchmark`'s figures as plain JSON-serialisable data (adds ``ratio``, ``overhead``)."""
    return {
        "config": report["config"],
        "environment": report["environment"],
        "distributed": [r.to_json() for r in report["distributed"]],
        "world1": [r.to_json() for r in report["world1"]],
    }


def write_sweep_plot(report: Dict[str, Any], path: str) -> None:
    """Write a PNG of median step time against ``pack_threshold``, one panel per workload.

    The default distopt mode is placed at the optimizer's default threshold;
    ``local``, ``ddp`` and ``bare_allreduce`` are horizontal reference lines.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["distributed"] or report["world1"]
    default = report["environment"]["distopt_default_pack_threshold"]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        points = sorted(
            (int(name.split("@", 1)[1]) if "@" in name else default, mode.median_ms)
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


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m distopt.benchmark",
        description="Step time of local (no communication), PyTorch DDP and distopt, "
        "interleaved in the same processes.",
    )
    p.add_argument("--workloads", default="mlp,wide,transformer",
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
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes (one fresh launch per mode)")
    p.add_argument("--no-world1", action="store_true", help="skip the world-size-1 section")
    p.add_argument("--seed", type=int, default=0, help="seed of model initialisation and data (default 0)")
    return p


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
        memory=not args.no_memory,
        world1=not args.no_world1,
        seed=args.seed,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        cfg = _config_from_args(args)
    except ValueError as exc:
        _parser().error(str(exc))
    started = time.perf_counter()
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


if __name__ == "__main__":
    sys.exit(main())
