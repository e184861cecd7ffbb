"""Replanning: from the old plan and what the ranks observed to the new plan, as pure functions.

Two things change the engine's plan once a round is back, and both are decided
from what every rank read in that same round, so every rank changes it at the
same point (the engine, :mod:`distopt.engine.engine`, does the communication and
applies the result):

- **The root's observed order** (:func:`observed_order`, :func:`replan`). After
  the first reducing round the root broadcasts the order its gradients arrived
  in; every rank plans the same packs from it, so that packs fill in arrival
  order. When the packs' membership is unchanged the old packs (and their
  buffers) stay.
- **Unfrozen parameters** (:func:`agree_on_unfrozen`, :func:`split_frozen`). A
  parameter frozen when the wrapper took it on and trainable now (or given a
  gradient by hand) raises a control flag; the ranks compare which ones they
  unfroze, and those leave the frozen list to be tracked.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .packing import PackSpec, ParamMeta, plan_packs

__all__ = ["observed_order", "replan", "Unfrozen", "agree_on_unfrozen", "split_frozen"]

#: One rank's report of the frozen parameters it made trainable (or gave a gradient by hand):
#: ``(name, how)`` pairs in tracking order; None from a rank that has joined (it follows the others).
Unfrozen = Optional[List[Tuple[str, str]]]


def observed_order(arrivals: Sequence[int], count: int) -> List[int]:
    """The plan order from the root's observed arrivals: those first, the rest in reverse index order.

    Args:
        arrivals: parameter indices in the order their gradients arrived (no repeats).
        count: parameters tracked.

    Raises:
        ValueError: an arrival is repeated or out of range.
    """
    seen = set(arrivals)
    if len(seen) != len(arrivals) or any(not 0 <= i < count for i in arrivals):
        raise ValueError(f"arrivals must be distinct parameter indices in 0..{count - 1}, got {list(arrivals)}")
    return list(arrivals) + [i for i in reversed(range(count)) if i not in seen]


def replan(old: Sequence[PackSpec], order: Sequence[int], metas: Sequence[ParamMeta],
           threshold: int, groups: Optional[Sequence[int]] = None) -> Optional[List[PackSpec]]:
    """The plan for ``order``, or None when it would hold the same packs as ``old``.

    Only which packs exist, and their order, matter to matching the ranks' collectives;
    keeping the old packs when those are unchanged also spares a second set of buffers
    at the peak.

    Args:
        old: the plan now.
        order: the new order of parameter indices (a permutation).
        metas: every parameter's size, device and dtype.
        threshold: the pack threshold in bytes.
        groups: per parameter, the group its pack must keep to (see :func:`plan_packs`), or None.
    """
    plan = plan_packs(order, metas, threshold, groups)
    if [set(spec.members) for spec in plan] == [set(spec.members) for spec in old]:
        return None
    return plan


def agree_on_unfrozen(everyone: Sequence[Unfrozen]) -> Dict[str, str]:
    """What every contributing rank unfroze: ``{name: how}``.

    Args:
        everyone: each rank's report, in rank order (None from a rank that has joined).

    Raises:
        ValueError: the contributing ranks unfroze different parameters, naming each rank's.
    """
    named = [theirs for theirs in everyone if theirs is not None]
    if not named:
        return {}
    if any(theirs != named[0] for theirs in named):
        detail = "; ".join(f"rank {r}: {dict(theirs)}" for r, theirs in enumerate(everyone) if theirs is not None)
        raise ValueError(
            f"different ranks made different frozen parameters trainable or gave them gradients ({detail}); set "
            "requires_grad, and any gradient set by hand, alike on every rank, at the same step"
        )
    return dict(named[0])


def split_frozen(frozen_names: Sequence[str], adopted: Dict[str, str]) -> Tuple[List[int], List[int]]:
    """Positions in the frozen list of the parameters to track now, and of those that stay frozen."""
    track = [k for k, name in enumerate(frozen_names) if name in adopted]
    stay = [k for k, name in enumerate(frozen_names) if name not in adopted]
    return track, stay
