"""Who left or joined, when, and at which step: the record a fault-tolerant wrapper keeps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

__all__ = ["MembershipEvent", "Record", "diff"]


@dataclass(frozen=True)
class MembershipEvent:
    """A change of the replicas that train together, seen by this replica at a quorum.

    Attributes:
        step: the committed step count when the new membership took over (the next step
            taken is ``step + 1``).
        time: ``time.time()`` when this replica saw it.
        quorum_id: torchft's quorum id.
        world_size: replicas whose gradients are averaged from now on (torchft's participants).
        rank: this replica's rank among them, or None while it heals (it takes part from
            its next step).
        members: the replicas in the quorum, as torchft's global ranks (the number at the end
            of each replica id, e.g. ``replica_2`` -> 2), when the process group reported
            them; else empty.
        left: replicas in the previous quorum and not in this one.
        joined: replicas in this quorum and not in the previous one.
        healed: this replica received the live state of a peer at this quorum.
    """

    step: int
    time: float
    quorum_id: int
    world_size: int
    rank: Optional[int]
    members: Tuple[int, ...] = ()
    left: Tuple[int, ...] = ()
    joined: Tuple[int, ...] = ()
    healed: bool = False

    def describe(self) -> str:
        """One line for the log."""
        parts = [f"step {self.step}: {self.world_size} replica(s) train together (quorum {self.quorum_id}"]
        if self.members:
            parts[0] += f", members {list(self.members)}"
        parts[0] += ")"
        if self.left:
            parts.append(f"left: {list(self.left)}")
        if self.joined:
            parts.append(f"joined: {list(self.joined)}")
        if self.healed:
            parts.append("this replica healed from a live peer")
        return "; ".join(parts)


def diff(before: Tuple[int, ...], after: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(left, joined)`` between two memberships (pure)."""
    return tuple(sorted(set(before) - set(after))), tuple(sorted(set(after) - set(before)))


@dataclass
class Record:
    """The events so far, and the counters ``opt.stats.fault_tolerance`` shows.

    Attributes:
        events: every membership change seen, oldest first.
        committed: steps committed.
        discarded: steps discarded (a collective failed, or too few replicas).
        heals: times this replica received a peer's state to train on (not counted: the state a
            replica that shadows after ``join()`` takes at each step).
        last_failure: the error of the last discarded step, in words ("" if none), and, once the
            next quorum is known, which replicas of that step stopped answering.
        missing: those replicas (torchft's replica numbers), or empty.
        shadowed: steps this replica shadowed after it ran out of data (``join()``), not counted
            as committed or discarded.
    """

    events: List[MembershipEvent] = field(default_factory=list)
    committed: int = 0
    discarded: int = 0
    heals: int = 0
    last_failure: str = ""
    missing: Tuple[int, ...] = ()
    shadowed: int = 0
