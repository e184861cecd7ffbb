"""The figures a run produces: :class:`ModeResult` per mode inside :class:`WorkloadResult` per workload.

Plain data (``dataclasses.asdict`` gives the ``--json`` shape), plus the derived
``ratio`` and ``overhead`` the report prints.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["ModeResult", "WorkloadResult"]

# Below this share of the floor, DDP's cost over ``local`` is within timing noise and
# ``overhead`` (a ratio of two such differences) would be noise too.
_MIN_COMM_SHARE = 0.05


@dataclass
class ModeResult:
    """Figures for one mode of one workload.

    Attributes:
        name: ``local``, ``ddp``, ``distopt``, ``distopt@<size>`` or ``bare_allreduce``.
        median_ms: median step time (slowest rank per step), milliseconds.
        p25_ms: 25th percentile step time.
        p75_ms: 75th percentile step time.
        allreduce_calls: collective calls per step: all-reduces, and distopt's all-gathers of
            gradients that travel as rows (None when not measured; a mean, so possibly
            fractional, for a mode that communicates every few steps).
        reduced_bytes: bytes put on the wire per step (None when not measured; a mean, likewise).
        peak_mem_bytes: peak memory growth of the mode (None when not probed).
        times_ms: every timed step, for ``--json`` consumers.
    """

    name: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    allreduce_calls: Optional[float] = None
    reduced_bytes: Optional[float] = None
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
        """Median step time of ``mode`` in ms, or None if it did not run.

        Args:
            mode: a mode name, e.g. ``"ddp"``.

        Returns:
            The mode's ``median_ms``, or None when ``mode`` is not in :attr:`modes`.
        """
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
        """The fields as plain data, plus ``ratio`` and ``overhead``.

        Returns:
            ``dataclasses.asdict(self)`` with ``ratio`` and ``overhead`` added.
        """
        out = asdict(self)
        out["ratio"] = self.ratio
        out["overhead"] = self.overhead
        return out
