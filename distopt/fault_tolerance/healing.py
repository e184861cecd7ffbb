"""The state a replacement receives from a live peer, and how it takes it.

torchft sends it (``register_state_dict_fn``, the HTTP checkpoint transport) to a
replica that joins behind the others, and loads it inside ``should_commit()``, right
before the step: so the replica then steps on the same averaged gradients from the same
state as everyone, and is bitwise identical after its first step.

The state is the wrapper's whole: the parameters it tracks, ``opt.state_dict()`` (the
inner optimizer's state; in local SGD the anchors, the steps since the last sync and the
outer optimizer; a compressor's state, of which the controller decides what the healer
takes: :mod:`distopt.fault_tolerance.compressor_state`), and the step count.

It also carries the live peer's wrapper settings, which the healer compares with its own
(:func:`check_settings`) *before its first collective*: torchft fetches the state inside the
quorum, so it is here (:func:`arrived`) once the quorum is, while the healer has sent nothing
yet. A healer built with other settings would otherwise run that step's collectives with the
live replicas, and a collective whose sizes differ aborts a process (gloo), a live one too.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

__all__ = ["snapshot", "arrived", "check_settings", "restore"]


def snapshot(params: List[Tensor], state_dict: Callable[[], Dict[str, Any]], steps: int,
             settings: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """What a live replica sends: copies, so that training may go on while it travels, and the
    wrapper's settings (the arguments that decide which collectives run), for the healer to check."""
    with torch.no_grad():
        return {
            "params": [p.detach().clone() for p in params],
            "optimizer": _cloned(state_dict()),
            "steps": steps,
            "settings": settings,
        }


def arrived(manager: Any, key: str) -> Optional[Dict[str, Any]]:
    """The :func:`snapshot` a heal has brought for the state registered under ``key``, or None.

    torchft (0.2.0) fetches a live peer's state inside the quorum (``Manager._async_quorum``,
    on its quorum thread) and keeps it, unloaded, in ``Manager._pending_state_dict`` as
    ``{"user": {key: snapshot, ...}, "torchft": ...}`` until ``should_commit()`` loads it. So
    once the quorum is done (``num_participants()`` waits for it) a replica that heals holds
    its peer's snapshot, before it has issued a collective of the step. None: this replica
    does not heal at this quorum, the fetch failed (the manager has the error, and the step
    sends nothing), or a manager that keeps it elsewhere (the comparison then runs only as
    the state is loaded, in ``should_commit()``).
    """
    pending = getattr(manager, "_pending_state_dict", None)
    user = pending.get("user") if isinstance(pending, dict) else None
    state = user.get(key) if isinstance(user, dict) else None
    return state if isinstance(state, dict) else None


def check_settings(state: Dict[str, Any], settings: Optional[Dict[str, Any]]) -> None:
    """Refuse a peer's :func:`snapshot` taken under other wrapper settings.

    Args:
        state: the peer's snapshot.
        settings: this replica's wrapper settings (None: nothing to compare), in the wrapper's
            order: the first that differs is named (the user's arguments come before the mode,
            which only backs them up).

    Raises:
        ValueError: a setting differs; the error names it, both values and the fix. Every
            replica must issue the same collectives, which these settings decide.
    """
    theirs = state.get("settings")
    if settings is None or theirs is None or theirs == settings:
        return
    key = next(k for k in [*settings, *(k for k in theirs if k not in settings)] if theirs.get(k) != settings.get(k))
    raise ValueError(
        f"this replica's DistributedOptimizer was built with {key}={settings.get(key)!r}, and the live replica it "
        f"heals from with {key}={theirs.get(key)!r}; every replica must pass the same arguments, since they decide "
        f"which collectives the replicas issue together: restart this replica with {key}={theirs.get(key)!r} (or, "
        "to change the setting, restart every replica with the new value)"
    )


def restore(state: Dict[str, Any], params: List[Tensor], load_state_dict: Callable[[Dict[str, Any]], None],
            set_steps: Callable[[int], None]) -> None:
    """Take a peer's :func:`snapshot`.

    Raises:
        ValueError: the peer's model differs from this one (number or shapes of parameters).
    """
    received: List[Tensor] = state["params"]
    if len(received) != len(params) or any(r.shape != p.shape for r, p in zip(received, params)):
        raise ValueError(
            "the state received from a live peer does not fit this model: it has parameters of shapes "
            f"{[tuple(r.shape) for r in received]}, this replica {[tuple(p.shape) for p in params]}; every "
            "replica must build the same model"
        )
    with torch.no_grad():
        for p, r in zip(params, received):
            p.copy_(r)
    load_state_dict(state["optimizer"])
    set_steps(int(state["steps"]))


def _cloned(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_cloned(v) for v in value)
    return value
