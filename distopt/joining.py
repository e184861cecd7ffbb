"""Uneven inputs: ranks that run out of data join, and keep the others' reductions going.

Inside ``with opt.join():`` a rank whose loop ends does not leave. It runs
shadow rounds: the same
packs, in the same plan order, filled with zeros and with its presence and
"contributing" flags at 0. The ranks still training see from the summed flags
how many ranks contributed, and average over those alone (or over the world,
with ``divide_by_world=True``). Nothing else travels while no rank has joined.

When a round comes back with no contributor, every rank has joined. If some
ranks stopped earlier than others, their parameters and optimizer state are
behind: one rank that took part in the last contributing round sends its own
to everyone, so every rank leaves the block with the same state, bitwise.

In local SGD (``sync_every > 1``, :mod:`distopt.modes.local_sgd`) a rank that
joins with local steps not yet averaged first sends them, as a contributor, in
one last exchange (:meth:`distopt.modes.Mode.leaving`); it then shadows the
others' exchanges like their gradient rounds. At the end, the mode's own state
(the last-sync copy, the outer optimizer) is settled with the rest.

Several optimizers trained in one loop (a GAN's two) join together
(:func:`join`): each has its own private group, so a joined rank keeps one
shadow round in flight per optimizer, in whatever order the others step them.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from . import collectives, stalls
from .stats import StepStats

if TYPE_CHECKING:
    from .engine import GradientEngine
    from .optimizer import DistributedOptimizer

__all__ = ["join", "join_and_wait"]

# Seconds between two looks at several optimizers' shadow rounds.
_POLL = 0.0005

_in_blocks: "set[int]" = set()  # ids of the wrappers inside a join block in this process


@contextlib.contextmanager
def join(*optimizers: "DistributedOptimizer", divide_by_world: bool = False) -> Iterator[None]:
    """Context around a loop with uneven inputs, for one or several optimizers stepped in it.

    See :meth:`distopt.DistributedOptimizer.join`; several optimizers stepped in the
    same loop must join together, in one block.

    Args:
        *optimizers: the loop's :class:`distopt.DistributedOptimizer`s.
        divide_by_world: count joined ranks as zeros in the average (default: False).

    Raises:
        TypeError: an argument is not a DistributedOptimizer.
        RuntimeError: a block is nested in another block of this process.

    Example::

        >>> with distopt.join(gen_opt, disc_opt):
        ...     for real in loader:              # a different number of batches per rank
        ...         train_step(real)
    """
    from .optimizer import DistributedOptimizer

    if not optimizers:
        raise TypeError("join() needs the DistributedOptimizers stepped in the loop, e.g. distopt.join(opt)")
    for opt in optimizers:
        if not isinstance(opt, DistributedOptimizer):
            raise TypeError(f"join() takes DistributedOptimizers, got {type(opt).__name__}")
        opt._check_not_retired("join()")
    if _in_blocks:
        raise RuntimeError(
            "join blocks cannot be nested: a rank that joins the inner one would leave the outer optimizer's "
            "rounds without it and the others would wait for ever. Join every optimizer of the loop in one "
            "block: `with distopt.join(opt1, opt2):`"
        )
    engines = [opt._engine for opt in optimizers]
    previous = [(e.in_join, e.divide_by_world) for e in engines]
    for engine in engines:
        engine.in_join, engine.divide_by_world = True, bool(divide_by_world)
    _in_blocks.update(id(opt) for opt in optimizers)
    try:
        yield
        # An exception in the body propagates at once: shadowing would hide it, and the
        # other ranks learn of it from the stall inspector when their next round fails.
        join_and_wait(optimizers)
    finally:
        _in_blocks.difference_update(id(opt) for opt in optimizers)
        for engine, (in_join, divide) in zip(engines, previous):
            engine.in_join, engine.divide_by_world = in_join, divide


def join_and_wait(optimizers: Sequence["DistributedOptimizer"]) -> int:
    """Take part in the other ranks' rounds with zeros until every rank has joined.

    Returns:
        The rank (in the first wrapper's group) whose state every rank now has: the
        highest of those that contributed to the last round with contributors, i.e.
        the last to join.
    """
    optimizers = [opt for opt in optimizers if opt.world_size > 1]
    if not optimizers:
        return 0
    for opt in optimizers:
        engine = opt._engine
        if engine.inflight:
            engine.finish_round()  # a round this rank left pending at the end of backward
        engine.reset_round()  # gradients accumulated but never reduced are not sent
        if engine.progress is not None:
            engine.progress.phase = "joined (it ran out of data and waits for the others)"
    # A mode's last contributing round (local steps not averaged yet), launched already; the
    # shadow rounds take its place until it is back.
    finals = {id(opt._engine): opt._mode.leaving(opt) for opt in optimizers}
    try:
        if len(optimizers) == 1:
            opt = optimizers[0]
            final = finals[id(opt._engine)]
            while True:
                if final is None:
                    _shadow_launch(opt._engine)
                if not _shadow_finish(opt._engine, final):
                    break
                final = None
                opt._mode.shadow_step(opt)
        else:
            _shadow_together(optimizers, finals)
    finally:
        for opt in optimizers:
            opt._engine.joined = False
    return [_settle(opt) for opt in optimizers][0]


def _shadow_launch(engine: "GradientEngine") -> None:
    """As a rank that has joined: send zeros for the others' next round."""
    with engine.lock:
        engine.stats = StepStats()
        engine.joined = True
        if engine.packs:
            engine.flush()
        else:  # nothing trainable: only the control flags travel, at once
            engine.control_round()


def _shadow_finish(engine: "GradientEngine", final: Optional[Callable[[], None]] = None) -> int:
    """Finish the shadow round (or ``final``, the mode's last round); return how many ranks contributed to it."""
    if final is not None:
        final()  # takes the engine's lock itself
    with engine.lock:
        if engine.inflight:
            engine.finish_round()
        engine.reset_round()
        return engine.contributors


def _shadow_together(optimizers: Sequence["DistributedOptimizer"],
                     finals: Dict[int, Optional[Callable[[], None]]]) -> None:
    """Keep one shadow round in flight per optimizer, finishing each as it comes back."""
    for opt in optimizers:
        if finals[id(opt._engine)] is None:
            _shadow_launch(opt._engine)
    active = list(optimizers)
    while active:
        progressed = False
        for opt in list(active):
            engine = opt._engine
            pending = next(((sent.index, sent.seq) for sent in engine.inflight if not sent.work.is_completed()), None)
            if pending is None:
                progressed = True
                if finals.get(id(engine)) is None:
                    with engine.lock:
                        arrived = engine._arrive(0.0)
                    if not arrived:
                        # A gradient's rows overflowed: its dense all-reduce is polled like the rest. Waiting
                        # for it here could wait on a rank that is itself waiting for another optimizer's.
                        continue
                if _shadow_finish(engine, finals.pop(id(engine), None)):
                    opt._mode.shadow_step(opt)
                    _shadow_launch(engine)
                else:
                    active.remove(opt)
            else:
                _watch(engine, *pending)
        if not progressed:
            time.sleep(_POLL)


def _watch(engine: "GradientEngine", k: int, seq: int) -> None:
    """A shadow round waited for by polling is watched like any wait."""
    progress = engine.progress
    if progress is None:
        return
    what = f"pack {k + 1}/{len(engine.packs)} of the gradient all-reduce (joined, sending zeros)"
    progress.begin(seq, what)
    if progress.raise_after is not None and progress.waited() >= progress.raise_after:
        raise stalls.stall_error(progress, seq, what)


def _settle(owner: "DistributedOptimizer") -> int:
    """Give every rank the state of one of the last ranks to contribute; return that rank."""
    engine = owner._engine
    group = owner._group()
    mine = torch.tensor([int(engine.contributed_last), owner._steps], dtype=torch.int64)
    with stalls.inspected(engine.progress, "the exchange at the end of the join block"):
        everyone: List[torch.Tensor] = collectives.all_gather(mine, group=group)
    contributed = [r for r, t in enumerate(everyone) if t[0].item()]
    steps = [int(t[1].item()) for t in everyone]
    last = max(contributed) if contributed else owner.root_rank
    identical = len(contributed) == len(everyone) and len(set(steps)) == 1
    owner._mode.settle_after_join(owner, last, identical)
    owner._steps = steps[last]
    if not identical:
        owner._mode.broadcast_state(owner, last)  # after the step count, which decides its phase
    engine.contributors = owner.world_size
    engine.contributed_last = True
    engine.reset_round()
    if engine.progress is not None:
        engine.progress.step = owner._steps
        engine.progress.end()
    return last
