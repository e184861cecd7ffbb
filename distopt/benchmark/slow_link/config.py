"""What one slow-link run does: :class:`LinkConfig`, checked when it is made."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from .contenders import CONTENDERS, ContenderOptions
from .rates import MAX_RATE, MIN_RATE, format_rate
from .tasks import TASKS

__all__ = ["LinkConfig"]

#: The largest link check transfer; smaller on slow links, so the check takes about a second.
PROBE_MAX_BYTES = 20 * 2**20
PROBE_MIN_BYTES = 256 * 2**10


@dataclass(frozen=True)
class LinkConfig:
    """One run of ``python -m distopt.benchmark --link RATE``.

    Attributes:
        rate_bps: the link rate, bits per second, each direction.
        tasks: names from :data:`~.tasks.TASKS`, in run order.
        contenders: names from :data:`~.contenders.CONTENDERS`, in run order.
        options: the contenders' settings (``--powersgd-rank``).
        quick: run each task's short schedule.
        rounds: interleaved rounds per task instead of its schedule's (None: the schedule's).
        seed: seeds the replicas and the batches.
        base_port: the first port of the contenders' process groups (inside the namespaces,
            so it cannot clash with the machine's).

    Raises:
        ValueError: an unknown task or contender, none of either, or a rate out of range.
    """

    rate_bps: int
    tasks: Tuple[str, ...] = tuple(TASKS)
    contenders: Tuple[str, ...] = tuple(CONTENDERS)
    options: ContenderOptions = field(default_factory=ContenderOptions)
    quick: bool = False
    seed: int = 0
    rounds: Optional[int] = None
    base_port: int = 29650

    def __post_init__(self) -> None:
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"--link-rounds={self.rounds!r} must be an integer of at least 1, e.g. 12")
        if not MIN_RATE <= self.rate_bps <= MAX_RATE:
            raise ValueError(f"--link={format_rate(self.rate_bps)} is out of range; choose a rate from "
                             f"{format_rate(MIN_RATE)} to {format_rate(MAX_RATE)}")
        for flag, names, known in (("--tasks", self.tasks, TASKS), ("--contenders", self.contenders, CONTENDERS)):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"{flag}: {', '.join(map(repr, unknown))} unknown; choose from {', '.join(known)}")
            if not names:
                raise ValueError(f"{flag} is empty; choose from {', '.join(known)}")
            if len(set(names)) != len(names):
                raise ValueError(f"{flag} names {', '.join(n for n in dict.fromkeys(names) if names.count(n) > 1)} "
                                 "more than once; name each once")

    @property
    def probe_bytes(self) -> int:
        """Bytes of the link check's transfer each way: about a second of the link, within 256 KiB-20 MiB."""
        return int(min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, self.rate_bps / 8)))

    def collective_timeout_s(self) -> float:
        """The contenders' process-group timeout: generous, since a slow link makes every collective slow."""
        return max(120.0, 40 * 2**27 / self.rate_bps)  # 40 transfers of 16 MiB

    def step_deadline_s(self, steps: int) -> float:
        """How long the supervisor waits for ``steps`` steps before it calls a contender hung."""
        return 60.0 + steps * (20.0 + 4 * 2**27 / self.rate_bps)
