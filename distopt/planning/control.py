"""The control flags every pack carries, and what the ranks learn from them once a round is back.

Each pack's tail holds, after one presence flag per member, :data:`CONTROL_FLAGS`
flags that the all-reduce sums over the ranks. Every rank reads the same sums,
so every rank draws the same conclusions at the same round, with no collective
of their own:

- where the ranks reduced: during backward, or only inside ``step()``;
- whether a parameter frozen when it was tracked is trainable now;
- how many ranks contributed gradients (the others have joined, see
  :meth:`distopt.DistributedOptimizer.join`), whether they are inside a join
  block, and whether they average over the contributors or the whole world;
- whether the contributing ranks have taken the same number of steps, to one
  step's parity: a rank that calls ``step()`` once more than the others (and then
  applies its gradients twice) is caught at the next round;
- whether the round is a closure's (``step(closure)``, e.g. LBFGS): a reduction of
  the closure's loss follows it, in which a rank that has joined takes part too;
- how many of the contributing ranks contribute for the last time (local SGD: a
  rank that ran out of data sends its last local steps, then joins), so that the
  ranks still training know who goes on with them (:attr:`Totals.training`)
  before they run a collective of their own, such as the drift check;
- whether the round is a probe: inside a join block, ``check_drift()`` on the ranks
  still training first sends a round of the shape a rank that has joined shadows (zeros,
  nothing averaged), to learn who trains now. A joined rank that shadowed it does
  nothing else for it, and the ranks that sent it read from its sums whether every rank
  took part (:meth:`distopt.engine.GradientEngine.probe`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from torch import Tensor

__all__ = ["CONTROL_FLAGS", "Control", "Totals", "SAME_JOIN_BLOCK"]

#: Flags after the presence flags of every pack.
CONTROL_FLAGS = 11

#: What to do when the ranks' join blocks differ: here, and in the stall inspector's errors.
SAME_JOIN_BLOCK = ("every rank must enter the same join block, with the same optimizers (`with opt.join():`, or "
                   "`with distopt.join(opt1, opt2):` for several), around the same training loop, a rank without "
                   "data too")


@dataclass(frozen=True)
class Control:
    """This rank's flags for one round."""

    during_backward: bool  # launched by the hooks, during backward
    inside_step: bool  # launched only by step(), because backward reduced nothing
    unfrozen: bool  # a parameter frozen when it was tracked is trainable now
    contributing: bool  # False once this rank has joined: it sends zeros
    in_join: bool  # inside a join block (or a Horovod optimizer, always ready to join)
    divide_by_world: bool  # joined ranks count in the average (DDP's and Horovod's way)
    counts_steps: bool = False  # this rank's step count is comparable (a gradient round it contributes to)
    odd_steps: bool = False  # it has taken an odd number of steps
    closure: bool = False  # a closure's round: the reduction of the closure's loss follows it
    leaving: bool = False  # it contributes for the last time: it ran out of data and has joined after this round
    probe: bool = False  # check_drift()'s probe round inside a join block: zeros, only its flags are read

    def tensor(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.tensor([float(f) for f in (self.during_backward, self.inside_step, self.unfrozen,
                                                  self.contributing, self.in_join, self.divide_by_world,
                                                  self.counts_steps, self.odd_steps, self.closure,
                                                  self.leaving, self.probe)],
                            dtype=dtype)


@dataclass(frozen=True)
class Totals:
    """The control flags summed over the ranks: the same on every rank."""

    during_backward: int
    inside_step: int
    unfrozen: int
    contributing: int
    in_join: int
    divide_by_world: int
    counts_steps: int
    odd_steps: int
    closure: int
    leaving: int = 0
    probe: int = 0

    @property
    def training(self) -> int:
        """Ranks that contributed and go on training: the others have joined, or join after this round."""
        return self.contributing - self.leaving

    @classmethod
    def read(cls, flags: List[Any], world_size: int, averaged: bool) -> "Totals":
        """Counts from the reduced flags (``averaged``: the backend divided the sum by the world).

        The flags have their pack's dtype: floats, or complex numbers with the count in the real part.
        """
        return cls(*(int(round(v.real * world_size if averaged else v.real)) for v in flags))

    def check(self, world_size: Optional[int]) -> None:
        """Raise the same error on every rank if the ranks are not in step with each other.

        Args:
            world_size: ranks whose flags are in the sums, or None where that is not known (under
                fault tolerance a replica that heals sends no flags, and at a job's first step torchft
                counts the replicas that take the primary's state among the participants). Unknown,
                a mix is caught only where it shows in the sums: fewer ranks in a join block than
                contributing ones (a replica that has joined is always inside one).

        Raises:
            RuntimeError: some ranks reduced during backward and others only inside ``step()``,
                or only some ranks are inside a join block, or they have taken different numbers
                of steps, or they average differently, or some ranks sent ``check_drift()``'s probe
                round and others a round of training.
        """
        if self.during_backward and self.inside_step:
            raise RuntimeError(_MIXED_ROUND)
        if 0 < self.probe < self.training:  # a rank that sends its last exchange (leaving) trains no more
            raise RuntimeError(
                f"{self.probe} of the {self.training} ranks training in this round called check_drift() "
                "inside a join block, and the others trained on (their gradients or local SGD's exchange met the "
                "check's probe round): call opt.check_drift() at the same point of the loop on every rank"
            )
        if self._mixed(self.in_join, world_size):
            # Said to ranks inside a block too, so it names what differs rather than asking for a block.
            of = f"{world_size} ranks" if world_size is not None else "the replicas"
            raise RuntimeError(
                f"{self.in_join} of {of} are inside a join block of this optimizer and the others are "
                f"not (they are outside any block, or in a block over other optimizers): {SAME_JOIN_BLOCK}"
            )
        if self.odd_steps not in (0, self.counts_steps):
            raise RuntimeError(
                f"the ranks have taken different numbers of steps: in this round {self.odd_steps} of "
                f"{self.counts_steps} contributing ranks had taken an odd number and the others an even one, so "
                "their parameters differ now. Some ranks called step() more often than the others (a step() under "
                "a rank-dependent condition, or a second step() for one batch), or reduced gradients the others "
                "did not (a synchronize() before backward() on some ranks only); call step() once per batch, and "
                "synchronize() alike, on every rank"
            )
        if self._mixed(self.divide_by_world, world_size):
            raise RuntimeError(
                f"{self.divide_by_world} of {world_size or 'the'} ranks called opt.join(divide_by_world=True) and "
                "the others divide_by_world=False; pass the same value on every rank"
            )

    def _mixed(self, count: int, world_size: Optional[int]) -> bool:
        """Whether some of the ranks raised a flag and others did not (see :meth:`check`)."""
        if world_size is None:
            return 0 < count < self.contributing
        return count not in (0, world_size)

    def rescale(self, world_size: int, mean: bool) -> float:
        """Factor that turns a mean over the world into a mean over the contributing ranks (1: none)."""
        if not mean or self.divide_by_world or self.contributing in (0, world_size):
            return 1.0
        return world_size / self.contributing


_MIXED_ROUND = (
    "ranks averaged their gradients at different points: some during backward(), others only inside step(), "
    "because their backward passes gave no gradient to any parameter this optimizer holds (a skipped batch "
    "with a constant loss, a detached loss) or were fewer than backward_passes_per_step. Code between "
    "backward() and step() (clipping, GradScaler, logging) would see different gradients on different ranks "
    "and the ranks would drift apart. Call opt.synchronize() right after backward() on every rank (it "
    "averages at once everywhere), or keep every rank's loss connected to the parameters "
    "(e.g. loss = model(x).sum() * 0.0)"
)
