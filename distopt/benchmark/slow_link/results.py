"""What a slow-link run measured: per contender (:class:`ContenderRun`), per task (:class:`TaskResult`).

Plain data, merged over the ranks as the step-time benchmark does: a step takes as
long as its slowest rank, its loss is the mean of the ranks' batch losses (the global
batch's loss), and its bytes the mean of what each rank's interface sent.

The real task's **target loss** (:func:`choose_target`) is what the reference
contender, DDP, reaches at 80% of the steps: its training loss averaged over a
trailing window (the per-step loss of a 32-window batch is noisy). Every contender
sees the same batches at the same step, so the same window of steps smooths them
alike; a contender has reached the target at the first step where its smoothed loss
is at or below it. DDP is the reference because it is exact synchronous SGD on the
global batch, the training every contender approximates; if it did not finish,
distopt (uncompressed), then local, stand in, and the report says which.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["ContenderRun", "Target", "TaskResult", "REFERENCES", "ALONE", "TARGET_FRACTION", "smoothed",
           "choose_target", "merge_ranks"]

#: The contenders whose loss sets the target, in order of preference.
REFERENCES = ("ddp", "distopt", "local")
#: The floor of the two-level contenders: each island alone, no cross-host traffic (``--ranks-per-host``).
ALONE = "island-alone"
#: The share of the steps at which the reference's loss becomes the target.
TARGET_FRACTION = 0.8

#: One rank's record of one step: ``(seconds, loss, interface bytes sent, distopt's stats.bytes or None)``.
Record = Tuple[float, float, int, Optional[int]]


def merge_ranks(per_rank: Sequence[Sequence[Record]]) -> List[Tuple[float, float, float, Optional[float]]]:
    """Merge the ranks' records of the same steps.

    Args:
        per_rank: each rank's records, step by step (equally long).

    Returns:
        Per step: ``(slowest rank's ms, mean loss, mean bytes sent, mean distopt bytes or None)``.

    Raises:
        ValueError: the ranks recorded different numbers of steps.
    """
    lengths = {len(records) for records in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"the ranks recorded {sorted(lengths)} steps; they must record the same steps")
    merged = []
    for steps in zip(*per_rank):
        distopt = [s[3] for s in steps]
        merged.append((max(s[0] for s in steps) * 1e3, statistics.fmean(s[1] for s in steps),
                       statistics.fmean(s[2] for s in steps),
                       None if any(d is None for d in distopt) else statistics.fmean(distopt)))  # type: ignore[misc]
    return merged


def smoothed(losses: Sequence[float], window: int) -> List[float]:
    """Trailing means: entry ``i`` is the mean of ``losses[max(0, i - window + 1):i + 1]``.

    Raises:
        ValueError: ``window`` is below 1.
    """
    if window < 1:
        raise ValueError(f"window={window!r} must be at least 1")
    out, total = [], 0.0
    for i, loss in enumerate(losses):
        total += loss
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclass
class ContenderRun:
    """One contender's figures on one task.

    Attributes:
        name: the contender.
        description: what it is.
        baseline: the uncompressed contender its final loss is compared with, if any.
        status: ``"ok"``; ``"unavailable"`` (its construction raised); ``"aborted"`` (a
            process died or raised while training); ``"hung"`` (no reply in time).
        reason: why, when not ok.
        step_ms: per recorded step, the slowest rank's milliseconds.
        losses: per recorded step, the ranks' mean training loss.
        sent_bytes: per recorded step, the mean over the ranks of the bytes their interface sent.
        distopt_bytes: per recorded step, distopt's ``stats.bytes`` (mean over ranks); empty for others.
        evals: ``(steps done, mean validation loss over the ranks' replicas)``.
        info: what its processes reported when ready (gradient bytes, distopt's pack threshold).
    """

    name: str
    description: str = ""
    baseline: Optional[str] = None
    status: str = "ok"
    reason: str = ""
    step_ms: List[float] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    sent_bytes: List[float] = field(default_factory=list)
    distopt_bytes: List[float] = field(default_factory=list)
    evals: List[Tuple[int, float]] = field(default_factory=list)
    info: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether it ran every step asked of it."""
        return self.status == "ok"

    def add(self, merged: Sequence[Tuple[float, float, float, Optional[float]]]) -> None:
        """Append :func:`merge_ranks`' steps."""
        for ms, loss, sent, distopt in merged:
            self.step_ms.append(ms)
            self.losses.append(loss)
            self.sent_bytes.append(sent)
            if distopt is not None:
                self.distopt_bytes.append(distopt)

    def fail(self, status: str, reason: str) -> None:
        """Mark it failed; the steps recorded so far stay."""
        self.status, self.reason = status, reason

    @property
    def median_ms(self) -> Optional[float]:
        """Median step time, or None before any step."""
        return statistics.median(self.step_ms) if self.step_ms else None

    @property
    def mean_ms(self) -> Optional[float]:
        """Mean step time (what time to a loss is made of), or None before any step."""
        return statistics.fmean(self.step_ms) if self.step_ms else None

    @property
    def sent_mib(self) -> Optional[float]:
        """Mean MiB a rank's interface sent per step, or None before any step."""
        return statistics.fmean(self.sent_bytes) / 2**20 if self.sent_bytes else None

    def elapsed_s(self) -> List[float]:
        """Seconds of training after each recorded step (the sum of its own step times)."""
        out, total = [], 0.0
        for ms in self.step_ms:
            total += ms / 1e3
            out.append(total)
        return out

    def final_val(self) -> Optional[float]:
        """The validation loss after the last recorded step, if it was evaluated there."""
        if self.evals and self.evals[-1][0] == len(self.step_ms):
            return self.evals[-1][1]
        return None

    def to_json(self) -> Dict[str, Any]:
        """Plain data, with the summary figures added."""
        out = asdict(self)
        out.update(median_ms=self.median_ms, mean_ms=self.mean_ms, sent_mib=self.sent_mib)
        return out


@dataclass(frozen=True)
class Target:
    """The real task's target loss and how it was chosen.

    Attributes:
        loss: the target.
        reference: the contender whose smoothed loss it is.
        step: the step (1-based) at which the reference had it.
        steps: the steps of the run.
        window: the trailing window, in steps, every contender's loss is smoothed over.
    """

    loss: float
    reference: str
    step: int
    steps: int
    window: int

    def describe(self) -> str:
        """How it was chosen, in words."""
        return (f"target loss {self.loss:.4f} = {self.reference}'s training loss at step {self.step} of {self.steps} "
                f"({100 * self.step / self.steps:.0f}%), every loss averaged over the trailing {self.window} steps")

    def steps_to(self, run: ContenderRun) -> Optional[int]:
        """The first step (1-based) at which ``run``'s smoothed loss is at or below the target, or None."""
        for i, loss in enumerate(smoothed(run.losses, self.window)):
            if loss <= self.loss:
                return i + 1
        return None

    def seconds_to(self, run: ContenderRun) -> Optional[float]:
        """Training seconds until :meth:`steps_to`, or None if never."""
        step = self.steps_to(run)
        return None if step is None else run.elapsed_s()[step - 1]


def choose_target(runs: Mapping[str, ContenderRun], steps: int, fraction: float = TARGET_FRACTION,
                  references: Sequence[str] = REFERENCES) -> Optional[Target]:
    """The target loss: the first of ``references`` that ran all ``steps``, at ``fraction`` of them.

    The window is a twentieth of the steps, at least 3.

    Args:
        runs: the task's contenders.
        steps: the steps each was to run.
        fraction: where in the run the reference's loss is read.
        references: candidates, in order of preference.

    Returns:
        The target, or None when no reference completed (or ``steps`` is 0).
    """
    if steps < 1 or not 0 < fraction <= 1:
        return None
    window = max(3, steps // 20)
    step = max(1, math.ceil(fraction * steps))
    for name in references:
        run = runs.get(name)
        if run is not None and run.ok and len(run.losses) >= steps and all(math.isfinite(x) for x in run.losses):
            return Target(smoothed(run.losses, window)[step - 1], name, step, steps, window)
    return None


@dataclass
class TaskResult:
    """One task's figures.

    Attributes:
        name: the task.
        description: what it trains.
        real: whether time to a target loss is reported.
        schedule: warm-up, rounds, chunk and evaluation period, as run.
        runs: every contender's figures, in run order.
        target: the target loss (real tasks whose reference finished).
    """

    name: str
    description: str
    real: bool
    schedule: Dict[str, int]
    runs: Dict[str, ContenderRun]
    target: Optional[Target] = None

    def local_mean_ms(self) -> Optional[float]:
        """``local``'s mean step time, the floor of time per step; None if it did not run."""
        run = self.runs.get("local")
        return run.mean_ms if run is not None and run.ok else None

    def local_median_ms(self) -> Optional[float]:
        """``local``'s median step time; None if it did not run."""
        run = self.runs.get("local")
        return run.median_ms if run is not None and run.ok else None

    def paired_ratio(self, name: str, reference: str = "local") -> Optional[float]:
        """Contender ``name``'s step time over ``reference``'s (``local``), paired by round: the median over
        the rounds of its chunk's mean step over ``reference``'s chunk's in the same round.

        Each round runs every contender's chunk one after the other, so a pair shares the
        machine's state of that moment; a host whose speed drifts by tens of per cent from one
        round to the next (shared machines do) moves both alike, and the median of the pairs
        keeps what the contender itself costs. None without ``reference`` or a whole round.
        """
        local, run, chunk = self.runs.get(reference), self.runs.get(name), int(self.schedule.get("chunk", 0))
        if local is None or run is None or not local.ok or chunk < 1:
            return None
        rounds = min(len(local.step_ms), len(run.step_ms)) // chunk
        if rounds < 1:
            return None
        ratios = [statistics.fmean(run.step_ms[r * chunk:(r + 1) * chunk])
                  / statistics.fmean(local.step_ms[r * chunk:(r + 1) * chunk]) for r in range(rounds)]
        return statistics.median(ratios)

    def to_json(self) -> Dict[str, Any]:
        """Plain data."""
        return {
            "name": self.name,
            "description": self.description,
            "real": self.real,
            "schedule": self.schedule,
            "paired_x_local": {name: self.paired_ratio(name) for name in self.runs},
            **({"paired_x_alone": {name: self.paired_ratio(name, ALONE) for name in self.runs}}
               if ALONE in self.runs else {}),
            "target": None if self.target is None else asdict(self.target),
            "runs": {name: run.to_json() for name, run in self.runs.items()},
        }
