"""A compressor's state across a fault-tolerant step: kept, put back, or taken from a peer.

A compressor (:mod:`distopt.compression`) changes its state while a round is in flight:
error feedback's residuals move as soon as a codec runs, PowerSGD's warm-started ``Q``
once its second sum is back. A step the vote discards must not keep those changes, or
the replicas that discarded it would go on from states that differ (``Q`` built from a
sum that failed half-way, residuals that owe what was never sent). So:

* **before each round** the state is copied (:meth:`CompressorState.before_round`): one
  copy of the residuals per step, the price of a discard that leaves no trace;
* **a discarded step** puts the copy back, on every replica that discarded it: every
  replica is where it was before the step, and those that were alike stay alike;
* **a committed step** keeps what the round made: ``Q`` is made of sums, so it is the
  same on every replica that committed;
* **a replica that heals** (it took part in the round sending zeros, then receives a
  live peer's state inside ``should_commit()``) takes no residual from the peer (the
  keys of :attr:`Compressor.per_rank_keys`): a residual is what *one* replica still owes
  the sum, and a copy would be paid twice, once by each holder. It starts them empty,
  which is exact for a fresh replacement and for a replica that missed a commit (its
  contribution was in the sum its peers committed). The rest (``Q``): if the step
  commits, its own, which its codecs built from the same sums as every peer's; if the
  step is discarded, the peer's, taken before the round, where every replica that
  discarded it goes back to.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..compression import Compressor

__all__ = ["CompressorState"]


class CompressorState:
    """The compressor's side of one fault-tolerant wrapper's steps.

    Args:
        compressor: the wrapper's compressor.
    """

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self._before: Optional[Dict[str, Any]] = None
        self._peer: Optional[Dict[str, Any]] = None
        self.discards_undone = 0  # discarded steps whose compressor changes were put back

    def before_round(self) -> None:
        """A round is about to run the codecs: copy the state it may change (``state_dict()`` clones)."""
        self._before = self.compressor.state_dict()

    def take_peer(self, state: Optional[Dict[str, Any]]) -> None:
        """A live peer's compressor state arrived with a heal; applied by :meth:`settle`."""
        self._peer = state

    def settle(self, committed: bool, healed: bool) -> None:
        """After the vote: keep the round's state, put the copy back, or take the peer's (see the module)."""
        compressor = self.compressor
        try:
            if healed:
                base = compressor.state_dict() if committed or self._peer is None else self._peer
                compressor.load_state_dict(_without_own(base, compressor))
            elif not committed and self._before is not None:
                compressor.load_state_dict(self._before)
                self.discards_undone += 1
        finally:
            self._before = self._peer = None


def _without_own(state: Dict[str, Any], compressor: Compressor) -> Dict[str, Any]:
    """``state`` less this rank's own parts (residuals): what every replica may share."""
    return {k: v for k, v in state.items() if k not in compressor.per_rank_keys}
