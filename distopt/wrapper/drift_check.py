"""The drift check's schedule and communication: ``check_every``, ``opt.check_drift()``, ``on_drift``.

What is compared, and how a difference is measured, is :mod:`distopt.planning.drift`'s;
what a mode keeps identical, and when, is the mode's
(:meth:`distopt.modes.Mode.kept_identical`). Here the ranks meet:

1. one all-reduce of every rank's fingerprints, one per parameter plus one for the
   shared items, as ``[x, -x]`` with MAX (the largest and the smallest over the
   ranks in one call), 16 bytes per parameter, on the wrapper's private group and
   watched by the stall inspector. When every fingerprint's largest equals its
   smallest, the ranks agree bit for bit, and that is all;
2. only otherwise, one gather of the details of the parameters that differ (their
   items' float64 means and RMS), so that every rank reads the same figures and
   raises, or warns, with the same text.

The schedule is counted in steps, which every rank counts alike (their parity
travels with every round), so every rank runs the same checks at the same steps.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from .. import collectives
from ..collectives.tensors import reduce_in_place, restore_from, to_comm
from ..modes import ModeContext
from ..planning import drift
from ..planning.stats import StepStats
from ..transport import stalls

__all__ = ["DEFAULT_CHECK_EVERY", "DriftCheck"]

#: Default ``check_every``: a check costs about one pass over the parameters and the state that is
#: compared (an integer sum at memory speed) and a 16-byte-per-parameter all-reduce; every 100
#: steps that is well under 1% of a step (docs/benchmark.md, "What the drift check costs").
DEFAULT_CHECK_EVERY = 100


class DriftCheck:
    """One wrapper's drift check: its settings, its schedule and its last findings.

    Args:
        every: steps between two scheduled checks; 0: none (``check_drift()`` still works).
        atol: differences up to ``atol + rtol * scale`` are tolerated (reported, not raised).
        rtol: see ``atol``; ``scale`` is the tensor's RMS (a number's absolute value).
        on_drift: ``"raise"`` :class:`~distopt.planning.drift.DriftError` or ``"warn"``
            :class:`~distopt.planning.drift.DriftWarning` beyond the tolerance.
    """

    def __init__(self, every: int, atol: float, rtol: float, on_drift: str) -> None:
        self.every = every
        self.atol = atol
        self.rtol = rtol
        self.on_drift = on_drift
        # Construction made the ranks alike (the broadcast), so the first check is due a period later.
        self.last_step = 0
        self.checks = 0
        self.report: Optional[drift.DriftReport] = None

    def due(self, steps: int) -> bool:
        """Whether a scheduled check is due at step count ``steps`` (a count set back by a
        checkpoint starts the schedule again)."""
        return self.every > 0 and not 0 <= steps - self.last_step < self.every

    def run(self, ctx: ModeContext, kept: drift.Kept, names: List[str]) -> drift.DriftReport:
        """Compare ``kept`` across the ranks; every rank must call it at the same point.

        Args:
            ctx: the wrapper, as the mode sees it (its private group, its progress).
            kept: what the mode keeps identical now.
            names: the parameters' names, in tracking order.

        Returns:
            What differs, the same on every rank; also kept as :attr:`report`.
        """
        progress, group = ctx.progress, ctx.group
        phase = None if progress is None else progress.phase
        if progress is not None:
            progress.phase = f"the drift check after step {ctx.steps}"
        try:
            fingerprints = drift.fingerprints(kept)
            n = len(fingerprints)
            # Below 2**52 every fingerprint is exact in float64; [x, -x] with MAX gives the largest
            # and the smallest over the ranks in one call.
            both = torch.tensor(fingerprints + [-f for f in fingerprints], dtype=torch.float64)
            with stalls.inspected(progress, "the drift check's fingerprints"):
                work = to_comm(both, group)
                reduce_in_place(work, "max", group)
                restore_from(both, work)
            high, low = both[:n].tolist(), (-both[n:]).tolist()
            report = drift.DriftReport(step=ctx.steps, compared=kept.compared, what=kept.what)
            differ = [slot for slot in range(n) if high[slot] != low[slot]]
            if differ:
                mine = {slot: drift.details(kept, slot) for slot in differ}
                with stalls.inspected(progress, "the drift check's exchange of what differs"):
                    everyone = collectives.all_gather_object(mine, group=group)
                report.drifted = drift.compare(everyone, names, self.atol, self.rtol)
        finally:
            if progress is not None:
                progress.phase = phase
        self.last_step = ctx.steps
        self.checks += 1
        self.report = report
        return report

    def act(self, report: drift.DriftReport, *, when: str, root: int, bcast_period: int, stacklevel: int) -> None:
        """Raise or warn, per ``on_drift``, when ``report`` holds a difference beyond the tolerance.

        Args:
            report: what :meth:`run` found.
            when: when the check ran, in words.
            root: the rank a re-broadcast sends from.
            bcast_period: the wrapper's ``bcast_period``.
            stacklevel: the user's frame as seen from this method's caller (1: the caller itself).

        Raises:
            DriftError: beyond the tolerance, with ``on_drift="raise"``.
        """
        if not report.beyond:
            return
        text = drift.message(report, when=when, atol=self.atol, rtol=self.rtol, on_drift=self.on_drift, root=root,
                             bcast_period=bcast_period)
        if self.on_drift == "raise":
            raise drift.DriftError(text, report)
        warnings.warn(text, drift.DriftWarning, stacklevel=stacklevel + 1)

    def fill(self, stats: StepStats) -> None:
        """Put the last check's figures into ``stats``."""
        stats.drift_checks = self.checks
        report = self.report
        if report is None:
            return
        stats.drift_step = report.step
        stats.drifted = len(report.drifted)
        stats.drift = report.drift
        stats.drift_name = report.name
        stats.drift_corrected = report.corrected
