"""What a reduction round did: :class:`StepStats`, read as ``opt.stats``."""
from __future__ import annotations

from dataclasses import dataclass

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
            and added up locally (:func:`distopt.engine.rounds.sums_by_gather`) counts here too.
        packs_at_flush: of those, how many launched only at the end of backward
            (the rest overlapped with backward).
        gathers: all-gathers launched: a large gradient whose rows are mostly zero
            (an embedding table's) sends only its non-zero rows, in place of its
            all-reduce (see :mod:`distopt.engine.sparse_rows`).
        bytes: bytes put on the wire.
        wait_seconds: time spent blocked waiting for communication.
        optimizer_state_bytes: bytes of optimizer state this rank holds (filled in by the wrapper).
        extra_state_bytes: memory the mode holds besides the model and the inner
            optimizer (local SGD: the parameters at the last sync, and the outer
            optimizer's state); 0 in synchronous training.
    """

    packs: int = 0
    all_reduces: int = 0
    packs_at_flush: int = 0
    gathers: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    optimizer_state_bytes: int = 0
    extra_state_bytes: int = 0
