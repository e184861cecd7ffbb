"""``join()``: training with uneven inputs, for one or several :class:`~distopt.DistributedOptimizer`\\ s.

Inside ``with opt.join():`` a rank whose loop ends does not leave. It runs shadow
rounds: the same packs, in the same plan order, filled with zeros and with its
presence and "contributing" flags at 0. The ranks still training see from the summed
flags how many ranks contributed, and average over those alone (or over the world,
with ``divide_by_world=True``). Nothing else travels while no rank has joined. When a
round comes back with no contributor, every rank has joined. If some ranks stopped
earlier than others, their parameters and optimizer state are behind: of the ranks
that took part in the last contributing round, the one with the most steps sends its
own to everyone, so every rank leaves the block with the state of a rank that ran the
longest, bitwise. A joined rank takes part in nothing but what the flags of the round
it shadowed announce (a closure's round is followed by the reduction of its loss), so
the ranks' collectives pair up whatever the others do between rounds. In local SGD a
rank that joins with local steps not yet averaged first sends them, as a contributor,
in one last exchange (:meth:`distopt.modes.Mode.leaving`); it then shadows the others'
exchanges like their gradient rounds. Several optimizers trained in one loop (a GAN's
two) join together (:func:`join`): each has its own private group, so a joined rank
keeps one shadow round in flight per optimizer, in whatever order the others step them.
A collective of the ranks still training (``check_drift()``) would meet a joined rank's
shadow round and wait for ever, so inside a block they first send a *probe round* of
the shape it shadows, flagged as such (:meth:`distopt.engine.GradientEngine.probe`): the
joined rank shadows it and does nothing else for it (it shadows the same packs again
next), and the ranks that sent it learn from its flags whether every rank trains on.

Each wrapper takes part through its :class:`JoinParty` (``opt.join_party``): its engine,
its mode and the mode's context, and its fault tolerance, never the wrapper itself.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import collectives
from ..engine import GradientEngine
from ..modes import Mode, ModeContext
from ..modes.synchronous import shadow_closure_loss
from ..transport import stalls

__all__ = ["JoinParty", "join", "join_and_wait"]

# Seconds between two looks at several optimizers' shadow rounds.
_POLL = 0.0005

_in_blocks: "set[int]" = set()  # ids of the parties inside a join block in this process


class JoinParty:
    """One wrapper's part in a join block: what its rounds do once this rank has run out of data.

    It holds the wrapper's collaborators, not the wrapper (which holds it).

    Args:
        engine: the wrapper's gradient engine.
        mode: the wrapper's mode.
        context: the mode's view of the wrapper.
        fault_tolerance: the wrapper's :class:`distopt.fault_tolerance.FaultTolerance`, or None.
        root_rank: the rank whose state every rank takes when no rank contributed.
        check_usable: raises, naming what was called (e.g. ``"join()"``), when the wrapper no longer
            reduces; held weakly where it is a bound method.
    """

    def __init__(self, *, engine: GradientEngine, mode: Mode, context: ModeContext, fault_tolerance: Any,
                 root_rank: int, check_usable: Callable[[str], None]) -> None:
        self.engine = engine
        self.mode = mode
        self.context = context
        self.fault_tolerance = fault_tolerance
        self.root_rank = root_rank
        self._check: Callable[[], Optional[Callable[[str], None]]] = (
            weakref.WeakMethod(check_usable) if hasattr(check_usable, "__self__")  # type: ignore[arg-type]
            else (lambda: check_usable))

    def check_usable(self, what: str) -> None:
        """Raise if the wrapper no longer reduces (see the constructor's ``check_usable``)."""
        check = self._check()
        if check is not None:
            check(what)

    @property
    def takes_part(self) -> bool:
        """Whether a joined rank has rounds to shadow: a world of more than one, or replicas under fault
        tolerance (where the world is the quorum's, step by step: a replica shadows whatever it is now)."""
        return self.engine.world_size > 1 or self.fault_tolerance is not None

    def enter(self, divide_by_world: bool) -> Tuple[bool, bool]:
        """The block begins; returns what :meth:`leave` restores."""
        previous = self.engine.enter_join(divide_by_world)
        if self.engine.progress is not None:  # for the other ranks' errors: a hint that fits a block
            self.engine.progress.in_join = True
        return previous

    def leave(self, previous: Tuple[bool, bool]) -> None:
        """The block ends (``previous``: what :meth:`enter` returned)."""
        self.engine.leave_join(previous)
        if self.engine.progress is not None:
            self.engine.progress.in_join = self.engine.progress.joined = False

    def check_fault_tolerant(self, count: int, divide_by_world: bool) -> None:
        """Refuse what join() cannot do under fault tolerance, with the reason.

        Args:
            count: optimizers in the block.
            divide_by_world: the block's ``divide_by_world``.

        Raises:
            ValueError: ``divide_by_world=True``.
            RuntimeError: several optimizers in one block, or local SGD.
        """
        if divide_by_world:
            raise ValueError(
                "join(divide_by_world=True) cannot be combined with fault_tolerance: the world there is the quorum of "
                "each step, and a replica that has joined heals at every step instead of taking part, so it is not "
                "counted in it; use join() (the mean over the replicas that contributed to the step)")
        if count > 1:
            raise RuntimeError(
                "join() over several optimizers is not supported with fault_tolerance: each optimizer's steps are "
                "quorums and commit votes of its own manager, and a replica that has joined shadows one of them at a "
                "time; join one fault-tolerant optimizer per block")
        if self.fault_tolerance is not None and not self.fault_tolerance.per_step:  # a quorum per sync, not per step
            raise RuntimeError(
                "join() is not supported with fault_tolerance in local SGD or DiLoCo: between two syncs the others ask "
                "for no quorum, so replicas that have joined and ask for one at once could form a quorum of their own, "
                "see no contributor and leave the block before the others' last sync. A replica that runs out of data "
                "can leave instead (manager.shutdown() and exit): the others go on without it from their next sync")

    def start_joined(self) -> Optional[Callable[[], None]]:
        """This rank ran out of data: settle what it left pending, and launch the mode's last round."""
        engine = self.engine
        if engine.inflight:
            engine.finish_round()  # a round this rank left pending at the end of backward
        engine.reset_round()  # gradients accumulated but never reduced are not sent
        if engine.progress is not None:
            engine.progress.phase = "joined (it ran out of data and waits for the others)"
            engine.progress.joined = True
        # A mode's last contributing round (local steps not averaged yet), launched already; the
        # shadow rounds take its place until it is back.
        return self.mode.leaving(self.context)

    def shadow_alone(self, final: Optional[Callable[[], None]]) -> None:
        """Shadow the others' rounds until every rank has joined (one optimizer)."""
        engine, ft = self.engine, self.fault_tolerance
        while True:
            if final is None:
                engine.shadow_launch()
            contributors = engine.shadow_finish(final)
            final = None
            if ft is not None:
                # Each shadow round is a step of the quorum: vote it down (this replica then heals from one
                # that trained, at the next quorum). A round whose collectives failed read no flags: who
                # still contributes is unknown, so shadow the next one.
                failed = ft.round_failed()
                ft.commit(joined=True)
                if failed:
                    continue
            if engine.outcome.probe:  # the others' check_drift() asked who trains: nothing follows it
                continue
            if not contributors:
                break
            self.follow_shadow_round()

    def shadow_poll(self, final: Optional[Callable[[], None]]) -> Optional[bool]:
        """One look at this optimizer's shadow round among several: None while it is in flight,
        True once it came back with contributors (the next one is launched), False once none."""
        engine = self.engine
        pending = engine.shadow_pending()
        if pending is not None:
            _watch(engine, pending.index, pending.seq)
            return None
        # A gradient's rows may have overflowed: its dense all-reduce is polled like the rest. Waiting
        # for it here could wait on a rank that is itself waiting for another optimizer's.
        if final is None and not engine.poll():
            return None
        if engine.shadow_finish(final):
            if not engine.outcome.probe:  # after the others' probe (check_drift()), nothing follows
                self.follow_shadow_round()
            engine.shadow_launch()
            return True
        return False

    def follow_shadow_round(self) -> None:
        """After a shadow round that had contributors: what the ranks still training did after theirs.

        Only what the round's control flags announce, which every rank read alike: a closure's
        round is followed by the reduction of its loss. Then the mode's part (a rank that skipped
        ``step()`` sends nothing the joined ranks would have to expect).
        """
        if self.engine.outcome.closure:
            shadow_closure_loss(self.context)
        self.mode.shadow_step(self.context)

    def settle(self) -> int:
        """Give every rank the state of a rank that ran the longest; return that rank.

        It is, of the ranks that contributed to the last round with contributors, the one that
        took the most steps (the highest of those): in local SGD the ranks' last local steps can
        meet in one final exchange, and all of them then contributed to it, whatever their counts.
        """
        engine, ctx = self.engine, self.context
        if self.fault_tolerance is not None:
            # Nothing to exchange: every replica took the state of one that trained the longest in the last
            # shadow round's heal (they all voted it down, so none moved past it).
            engine.after_join()
            return self.fault_tolerance.rank
        mine = torch.tensor([int(engine.outcome.contributed_last), engine.steps], dtype=torch.int64)
        with stalls.inspected(engine.progress, "the exchange at the end of the join block"):
            everyone: List[Tensor] = collectives.all_gather(mine, group=ctx.group)
        contributed = [r for r, t in enumerate(everyone) if t[0].item()]
        steps = [int(t[1].item()) for t in everyone]
        last = max(contributed, key=lambda r: (steps[r], r)) if contributed else self.root_rank
        identical = len(contributed) == len(everyone) and len(set(steps)) == 1
        self.mode.settle_after_join(ctx, last, identical)
        ctx.set_steps(steps[last])
        if not identical:
            self.mode.broadcast_state(ctx, last)  # after the step count, which decides its phase
        engine.after_join()
        if engine.progress is not None:
            engine.progress.end()
        return last


def _party(opt: Any) -> JoinParty:
    """``opt``'s :class:`JoinParty` (a proxy of a wrapper, such as Lightning's, forwards to the wrapper's).

    Raises:
        TypeError: ``opt`` is not a DistributedOptimizer.
    """
    party = getattr(opt, "join_party", None)
    if not isinstance(party, JoinParty):
        raise TypeError(f"join() takes DistributedOptimizers, got {type(opt).__name__}")
    return party


@contextlib.contextmanager
def join(*optimizers: Any, divide_by_world: bool = False) -> Iterator[None]:
    """Context around a loop with uneven inputs, for one or several optimizers stepped in it.

    See :meth:`DistributedOptimizer.join`; several optimizers stepped in the
    same loop must join together, in one block.

    Args:
        *optimizers: the loop's :class:`DistributedOptimizer`\\ s.
        divide_by_world: count joined ranks as zeros in the average (default: False).

    Raises:
        TypeError: an argument is not a DistributedOptimizer.
        RuntimeError: a block is nested in another block of this process; or one of several optimizers
            joins alone (:meth:`distopt.modes.Mode.joins_alone`: ``distopt.Islands``), on every rank at once.

    Example::

        >>> with distopt.join(gen_opt, disc_opt):
        ...     for real in loader:              # a different number of batches per rank
        ...         train_step(real)
    """
    if not optimizers:
        raise TypeError("join() needs the DistributedOptimizers stepped in the loop, e.g. distopt.join(opt)")
    parties = [_party(opt) for opt in optimizers]
    for party in parties:
        party.check_usable("join()")
    if _in_blocks:
        raise RuntimeError(
            "join blocks cannot be nested: a rank that joins the inner one would leave the outer optimizer's "
            "rounds without it and the others would wait for ever. Join every optimizer of the loop in one "
            "block: `with distopt.join(opt1, opt2):`"
        )
    for party in parties:
        if party.fault_tolerance is not None:
            party.check_fault_tolerant(len(parties), divide_by_world)
    alone = next((party for party in parties if len(parties) > 1 and party.mode.joins_alone(party.context)), None)
    if alone is not None:  # before any collective: every rank raises here alike
        raise RuntimeError(
            f"{alone.mode.describe()} cannot join in one block with other optimizers: a rank that runs out of data "
            "follows its rounds in a loop of their own (Islands: until every island has run out), and the other "
            "optimizers' rounds would wait for that rank. Give every rank the same number of batches for a loop that steps several optimizers "
            "(e.g. DistributedSampler(drop_last=True)), or step this optimizer in a loop of its own inside "
            "`with opt.join():`"
        )
    previous = [party.enter(divide_by_world) for party in parties]
    _in_blocks.update(id(party) for party in parties)
    try:
        yield
        # An exception in the body propagates at once: shadowing would hide it, and the
        # other ranks learn of it from the stall inspector when their next round fails.
        _join_and_wait(parties)
    finally:
        _in_blocks.difference_update(id(party) for party in parties)
        for party, before in zip(parties, previous):
            party.leave(before)


def join_and_wait(optimizers: Sequence[Any]) -> int:
    """Take part in the other ranks' rounds with zeros until every rank has joined.

    Args:
        optimizers: the :class:`DistributedOptimizer`\\ s stepped in the loop.

    Returns:
        The rank (in the first wrapper's group) whose state every rank now has: of those
        that contributed to the last round with contributors (the last to join), the one
        that took the most steps, the highest of those.
    """
    return _join_and_wait([_party(opt) for opt in optimizers])


def _join_and_wait(parties: Sequence[JoinParty]) -> int:
    parties = [party for party in parties if party.takes_part]
    if not parties:
        return 0
    finals = [party.start_joined() for party in parties]
    try:
        if len(parties) == 1:
            parties[0].shadow_alone(finals[0])
        else:
            _shadow_together(parties, finals)
    finally:
        for party in parties:
            party.engine.stop_shadowing()
    return [party.settle() for party in parties][0]


def _shadow_together(parties: Sequence[JoinParty], finals: List[Optional[Callable[[], None]]]) -> None:
    """Keep one shadow round in flight per optimizer, finishing each as it comes back."""
    final_of = {id(party): final for party, final in zip(parties, finals) if final is not None}
    for party in parties:
        if id(party) not in final_of:
            party.engine.shadow_launch()
    active = list(parties)
    while active:
        progressed = False
        for party in list(active):
            outcome = party.shadow_poll(final_of.get(id(party)))
            if outcome is None:
                continue
            progressed = True
            final_of.pop(id(party), None)
            if not outcome:
                active.remove(party)
        if not progressed:
            time.sleep(_POLL)


def _watch(engine: GradientEngine, k: int, seq: int) -> None:
    """A shadow round waited for by polling is watched like any wait."""
    progress = engine.progress
    if progress is None:
        return
    what = f"pack {k + 1}/{len(engine.packs)} of the gradient all-reduce (joined, sending zeros)"
    progress.begin(seq, what)
    if progress.raise_after is not None and progress.waited() >= progress.raise_after:
        raise stalls.stall_error(progress, seq, what)
