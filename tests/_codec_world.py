"""Codecs in a simulated world: one codec generator per rank, driven in one process.

:func:`simulate` carries out each collective the ranks' codecs yield in plain torch, on the
data's device, checking that every rank asks for the same collective of the same size at the
same point, the way the engine's fixed plan requires.
"""
import math

import torch

from distopt.compression import AllGather, AllReduce, AllToAll, PackLayout, Round

__all__ = ["layout_of", "factor_of", "simulate"]


def layout_of(shapes, members=None, device="cpu", dtype=torch.float32):
    """A pack of members of these shapes (float32 unless told), one after the other."""
    offsets, at = [], 0
    for shape in shapes:
        offsets.append(at)
        at += math.prod(shape)
    members = tuple(range(len(shapes))) if members is None else tuple(members)
    return PackLayout(members=members, names=tuple(f"p{i}" for i in members),
                      shapes=tuple(torch.Size(s) for s in shapes), offsets=tuple(offsets), numel=at,
                      dtype=dtype, device=torch.device(device))


def factor_of(contributing):
    """What the engine multiplies a round's sum by (the mean over the ranks that contributed), from its flags."""
    count, world = sum(contributing), len(contributing)
    return world / count if 0 < count < world else 1.0


def simulate(codecs, datas, step=0, contributing=None, exchange=False, factor=1.0):
    """Run one round of ``codecs[r]`` on ``datas[r]`` for every rank r; return the collectives' kinds and sizes.

    As the engine does, each codec's ``Round.outcome`` is filled in (from which ranks contribute) before it is
    resumed after its first collective; ``factor`` is the factor it is told to expect (``Round.factor``).
    """
    world = len(codecs)
    contributing = contributing or [True] * world
    rounds = [Round(rank=r, world_size=world, step=step, contributing=contributing[r], exchange=exchange,
                    factor=factor) for r in range(world)]
    gens = [c.reduce(d, rnd) for c, d, rnd in zip(codecs, datas, rounds)]
    asked = [next(g, None) for g in gens]
    trace = []
    while asked[0] is not None:
        kinds = {(type(a).__name__, a.tensor.numel(), a.tensor.dtype) for a in asked}
        assert len(kinds) == 1, f"the ranks asked for different collectives: {kinds}"
        trace.append(kinds.pop()[:2])
        first = asked[0]
        if isinstance(first, AllReduce):
            total = sum(a.tensor.clone() for a in asked)
            for a in asked:
                a.tensor.copy_(total)
        elif isinstance(first, AllGather):
            stacked = torch.cat([a.tensor for a in asked])
            for a in asked:
                a.out.copy_(stacked)
        elif isinstance(first, AllToAll):
            chunks = [a.tensor.view(world, -1) for a in asked]
            for j, a in enumerate(asked):
                a.out.view(world, -1).copy_(torch.stack([chunks[i][j] for i in range(world)]))
        for rnd in rounds:  # the flags are back with the first collective
            if rnd.outcome.factor is None:
                rnd.outcome.contributors, rnd.outcome.factor = sum(contributing), factor_of(contributing)
                rnd.outcome.exchange = exchange if any(contributing) and not all(contributing) else None
        asked = [next(g, None) for g in gens]
        assert all(a is None for a in asked) == (asked[0] is None), "a rank's codec ended before the others'"
    return trace
