"""What a reduction round did, and what the last drift check found: :class:`StepStats`, read as ``opt.stats``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What the last reduction round did.

    Attributes:
        packs: packs launched.
        all_reduces: all-reduces launched: one per pack, two for a pack of one large
            gradient, which is sent where autograd left it and its flags apart (only
            the flags' when the gradient is gathered as rows, and one more when its
            rows overflowed and it went dense). A small CPU sum sent as an all-gather
            and added up locally (:func:`distopt.engine.in_flight.sums_by_gather`) counts here too.
        packs_at_flush: of those, how many launched only at the end of backward
            (the rest overlapped with backward).
        gathers: all-gathers launched: a large gradient whose rows are mostly zero
            (an embedding table's) sends only its non-zero rows, in place of its
            all-reduce (see :mod:`distopt.engine.sparse_rows`).
        bytes: bytes put on the wire.
        parameter_bytes: of ``bytes``, those of the updated parameters this rank sent to the
            others after its step, with ``shard_state=True`` (counted when the step launches them).
        wait_seconds: time spent blocked waiting for communication.
        optimizer_state_bytes: bytes of optimizer state this rank holds (filled in by the wrapper).
        extra_state_bytes: memory the mode holds besides the model and the inner
            optimizer (local SGD: the parameters at the last sync, and the outer
            optimizer's state); 0 in synchronous training.
        drift_checks: drift checks run so far (``check_every``, before ``bcast_period``
            re-broadcasts, and ``check_drift()``); the fields below are the last one's
            (filled in by the wrapper).
        drift_step: the step count at the last drift check (0: none yet).
        drifted: tensors and values that differed between ranks at the last drift check,
            in any bit, within the tolerance or not; 0: the ranks agreed bit for bit.
        drift: the largest drift the last check found: the larger spread over the ranks of
            a tensor's mean and RMS, in its own units (``p.add_(1e-3)`` on one rank reads
            1e-3), ``inf`` for a shape or an entry that differs; 0.0 when nothing differed.
        drift_name: where that largest drift was (``"parameter '0.weight'"``); ``""`` if none.
        pack_threshold: the pack size in bytes the packs are planned with (with
            ``pack_threshold="auto"``, the one the root chose from the link's timing).
        drift_corrected: None, or, when the last check ran right before a ``bcast_period``
            re-broadcast, the largest parameter drift that re-broadcast overwrote (0.0: the
            ranks agreed already).
        fault_tolerance: with ``fault_tolerance=``, this replica's view: ``world_size`` and ``rank``
            (the replicas averaged in the last step, and this one's place), steps ``committed`` and
            ``discarded``, ``heals``, ``last_failure`` and ``last_event`` (a
            :class:`distopt.fault_tolerance.MembershipEvent`); None otherwise.
    """

    packs: int = 0
    all_reduces: int = 0
    packs_at_flush: int = 0
    gathers: int = 0
    bytes: int = 0
    parameter_bytes: int = 0
    wait_seconds: float = 0.0
    optimizer_state_bytes: int = 0
    extra_state_bytes: int = 0
    drift_checks: int = 0
    drift_step: int = 0
    drifted: int = 0
    drift: float = 0.0
    drift_name: str = ""
    drift_corrected: Optional[float] = None
    pack_threshold: int = 0
    fault_tolerance: Optional[Dict[str, Any]] = None
