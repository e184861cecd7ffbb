"""What one slow-link run does: :class:`LinkConfig`, checked when it is made."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from .contenders import CONTENDERS, ISLAND_CONTENDERS, ContenderOptions
from .rates import MAX_RATE, MIN_RATE, format_rate
from .tasks import TASKS

__all__ = ["LinkConfig", "default_contenders", "MAX_RANKS_PER_HOST"]

#: The most ranks ``--ranks-per-host`` starts in a namespace.
MAX_RANKS_PER_HOST = 8
#: The contenders of a run of two ranks per host and more, by default: the floors, the flat ones to beat, and
#: the two-level ones (:data:`~.contenders.ISLAND_CONTENDERS`).
_TWO_LEVEL_DEFAULT = ("local", "ddp", "distopt", *(c.name for c in ISLAND_CONTENDERS))


def default_contenders(ranks_per_host: int) -> Tuple[str, ...]:
    """The contenders a run takes without ``--contenders``.

    Args:
        ranks_per_host: ranks in each namespace.

    Returns:
        One rank per host: every flat contender. More: ``local``, ``ddp``, ``distopt`` and
        every two-level contender, which is what that topology is for.
    """
    if ranks_per_host > 1:
        return _TWO_LEVEL_DEFAULT
    return tuple(name for name in CONTENDERS if name not in {c.name for c in ISLAND_CONTENDERS})

#: The largest link check transfer; smaller on slow links, so the check takes about a second.
PROBE_MAX_BYTES = 20 * 2**20
PROBE_MIN_BYTES = 256 * 2**10


@dataclass(frozen=True)
class LinkConfig:
    """One run of ``python -m distopt.benchmark --link RATE``.

    Attributes:
        rate_bps: the link rate, bits per second, each direction.
        tasks: names from :data:`~.tasks.TASKS`, in run order.
        contenders: names from :data:`~.contenders.CONTENDERS`, in run order (None:
            :func:`default_contenders`; the attribute is the tuple once made).
        options: the contenders' settings (``--powersgd-rank``).
        quick: run each task's short schedule.
        rounds: interleaved rounds per task instead of its schedule's (None: the schedule's).
        seed: seeds the replicas and the batches.
        base_port: the first port of the contenders' process groups (inside the namespaces,
            so it cannot clash with the machine's).
        ranks_per_host: ranks in each namespace (``--ranks-per-host``): loopback between them, the
            shaped link between the namespaces.

    Raises:
        ValueError: an unknown task or contender, none of either, a rate out of range, ranks per
            host out of 1-8, or a two-level contender with one rank per host.
    """

    rate_bps: int
    tasks: Tuple[str, ...] = tuple(TASKS)
    contenders: Optional[Tuple[str, ...]] = None
    options: ContenderOptions = field(default_factory=ContenderOptions)
    quick: bool = False
    seed: int = 0
    rounds: Optional[int] = None
    base_port: int = 29650
    ranks_per_host: int = 1

    def __post_init__(self) -> None:
        if (isinstance(self.ranks_per_host, bool) or not isinstance(self.ranks_per_host, int)
                or not 1 <= self.ranks_per_host <= MAX_RANKS_PER_HOST):
            raise ValueError(f"--ranks-per-host={self.ranks_per_host!r} must be an integer from 1 to "
                             f"{MAX_RANKS_PER_HOST}, e.g. 2")
        if self.contenders is None:
            object.__setattr__(self, "contenders", default_contenders(self.ranks_per_host))
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
        two_level = [n for n in self.contenders if n in {c.name for c in ISLAND_CONTENDERS}]
        if two_level and self.ranks_per_host < 2:
            raise ValueError(f"--contenders: {', '.join(two_level)} train(s) on two levels and need(s) two ranks per "
                             "host or more; add --ranks-per-host 2")

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
