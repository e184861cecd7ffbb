"""Streaming local SGD's fragments: the model cut into F contiguous pieces of about equal bytes.

Streaming DiLoCo (Douillard et al. 2025) syncs the model one *fragment* at a time,
each on its own schedule (:mod:`distopt.planning.schedule`), so that the bytes of a
sync are spread over the period instead of sent at once. A fragment here is a run
of consecutive parameters in the order the wrapper tracks them (the order of the
param groups, which for a ``model.parameters()`` is the model's order: a run of
layers, the paper's "sequential" fragments), with runs balanced by bytes.

Everything here is a pure function of the parameters' sizes and F, so every rank,
holding the same parameters (checked when the wrapper is built), plans the same
fragments, and a run resumed from a checkpoint plans the same ones again. The
engine keeps a fragment's parameters in packs of their own
(:func:`distopt.planning.packing.plan_packs` with ``groups``), so that one
fragment travels as a subset of the plan's packs.
"""
from __future__ import annotations

from typing import List, Sequence

__all__ = ["split_fragments", "fragment_of"]


def split_fragments(nbytes: Sequence[int], fragments: int) -> List[range]:
    """Cut the parameters ``0..n-1`` into ``min(fragments, n)`` contiguous runs balanced by bytes.

    Run ``k`` ends where the cumulative bytes come nearest ``(k + 1) / F`` of the total,
    moved just enough that every run holds at least one parameter. So no run holds more
    than ``total / F + the largest parameter`` bytes (a property test checks it).

    Args:
        nbytes: each parameter's bytes, in tracking order.
        fragments: how many runs are wanted (F >= 1).

    Returns:
        The runs, as ranges of parameter indices, in order; ``[]`` for no parameters.

    Raises:
        ValueError: ``fragments < 1`` or a negative size.

    Example::

        split_fragments([4, 4, 4, 4], 2)     # -> [range(0, 2), range(2, 4)]
        split_fragments([1, 1, 6, 1], 2)    # -> [range(0, 2), range(2, 4)]
    """
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be an int >= 1, got {fragments!r}")
    if any(n < 0 for n in nbytes):
        raise ValueError(f"nbytes must be sizes >= 0, got {list(nbytes)}")
    count = len(nbytes)
    runs = min(fragments, count)
    if runs == 0:
        return []
    total = sum(nbytes)
    prefix = [0]
    for n in nbytes:
        prefix.append(prefix[-1] + n)
    cuts = [0]
    for k in range(1, runs):
        # The end nearest k/runs of the total: the first whose prefix reaches it, or the one before
        # if that is nearer (integer arithmetic: exact on every rank).
        end = next(i for i in range(1, count + 1) if prefix[i] * runs >= k * total)
        if k * total - prefix[end - 1] * runs < prefix[end] * runs - k * total:
            end -= 1
        # At least one parameter per run, and room for one in each of the runs still to come.
        end = min(max(end, cuts[-1] + 1), count - (runs - k))
        cuts.append(end)
    cuts.append(count)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def fragment_of(runs: Sequence[range]) -> List[int]:
    """Each parameter's fragment, from :func:`split_fragments`' runs."""
    return [f for f, run in enumerate(runs) for _ in run]
