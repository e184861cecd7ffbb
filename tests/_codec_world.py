"""Codecs in a simulated world: one codec generator per rank, driven in one process.

:func:`simulate` carries out each collective the ranks' codecs yield in plain torch, on the
data's device, checking that every rank asks for the same collective of the same size at the
same point, the way the engine's fixed plan requires.
"""
import math

import torch

from distopt.compression import AllGather, AllReduce, AllToAll, PackLayout, Round

__all__ = ["layout_of", "simulate"]


def layout_of(shapes, members=None, device="cpu"):
    """A pack of float32 members of these shapes, one after the other."""
    offsets, at = [], 0
    for shape in shapes:
        offsets.append(at)
        at += math.prod(shape)
    members = tuple(range(len(shapes))) if members is None else tuple(members)
    return PackLayout(members=members, names=tuple(f"p{i}" for i in members),
                      shapes=tuple(torch.Size(s) for s in shapes), offsets=tuple(offsets), numel=at,
                      dtype=torch.float32, device=torch.device(device))


def simulate(codecs, datas, step=0, contributing=None, exchange=False):
    """Run one round of ``codecs[r]`` on ``datas[r]`` for every rank r; return the collectives' kinds and sizes."""
    world = len(codecs)
    contributing = contributing or [True] * world
    gens = [c.reduce(d, Round(rank=r, world_size=world, step=step, contributing=contributing[r], exchange=exchange))
            for r, (c, d) in enumerate(zip(codecs, datas))]
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
        asked = [next(g, None) for g in gens]
        assert all(a is None for a in asked) == (asked[0] is None), "a rank's codec ended before the others'"
    return trace
