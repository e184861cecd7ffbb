"""The flat keyword arguments as shorthands for a mode: ``sync_every=16`` is ``mode=distopt.LocalSGD(every=16)``.

:class:`distopt.DistributedOptimizer` takes ``mode=`` or these keywords, and hands both to
:func:`resolve`; the wrapper knows no mode's arguments. The shorthands, and the mode each builds:

=================================================  ==============================================
``shard_state=True``                               :class:`~distopt.modes.sharded.ShardedState`
``shard_state="gradients"``                        ``ShardedState(gradients=True)`` (ZeRO-2)
``sync_every=H`` (> 1), ``local_warmup=W``         :class:`~distopt.modes.diloco.LocalSGD`
``outer_optimizer=f`` (with any ``sync_every``)    :class:`~distopt.modes.diloco.DiLoCo`
``sync_fragments``, ``sync_overlap``,              their ``fragments``, ``overlap``, ``mixing``
``sync_mixing``
none of them                                       :class:`~distopt.modes.synchronous.Synchronous`
=================================================  ==============================================

A mode built here names its arguments as the keywords were written in its error messages
(:attr:`~distopt.modes.base.Mode.spelling`), and its settings, compared across ranks, are
keyed by these keywords whichever way the mode was asked for (:func:`settings_of`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .base import Mode, OuterFactory
from .diloco import DiLoCo, LocalSGD, check_arguments
from .sharded import ShardedState
from .synchronous import Synchronous

__all__ = ["DEFAULTS", "SPELLING", "resolve", "from_keywords", "given", "settings_of"]

#: Each shorthand keyword's default, as :class:`distopt.DistributedOptimizer`'s signature has it.
DEFAULTS: Dict[str, Any] = {"shard_state": False, "sync_every": 1, "outer_optimizer": None, "local_warmup": 0,
                            "sync_fragments": None, "sync_overlap": None, "sync_mixing": None}

#: Local SGD's constructor arguments, as the shorthands spell them.
SPELLING: Dict[str, str] = {"every": "sync_every", "outer": "outer_optimizer", "warmup": "local_warmup",
                            "fragments": "sync_fragments", "overlap": "sync_overlap", "mixing": "sync_mixing"}

#: The settings the shorthands stand for, as a wrapper has them unless its mode says otherwise
#: (``sync_every=1`` without an outer optimizer is synchronous training), so that two ranks in
#: different modes differ in an argument rather than only in their mode.
_UNSET_SETTINGS: Dict[str, Any] = {"shard_state": False, "sync_every": 1, "local_warmup": 0, "outer_optimizer": False,
                                   "sync_fragments": None, "sync_overlap": None, "sync_mixing": None}


def given(keywords: Dict[str, Any]) -> List[str]:
    """The shorthand keywords in ``keywords`` that differ from their defaults, as ``name=value``."""
    out = []
    for name, value in keywords.items():
        default = DEFAULTS[name]
        if value is default or (type(value) is type(default) and value == default):
            continue
        out.append(f"{name}={'...' if callable(value) else repr(value)}")
    return out


def resolve(mode: Optional[Mode], **keywords: Any) -> Mode:
    """The mode a wrapper was asked for: ``mode`` itself, or the one the shorthand ``keywords`` build.

    Raises:
        TypeError: ``mode`` is not a :class:`~distopt.modes.base.Mode`, or is given with a shorthand.
        TypeError, ValueError: a bad shorthand (see :func:`from_keywords`).
    """
    if mode is None:
        return from_keywords(**keywords)
    if not isinstance(mode, Mode):
        raise TypeError(
            f"mode must be a distopt mode, e.g. mode=distopt.LocalSGD(every=16) or mode=distopt.ShardedState(), "
            f"got {type(mode).__name__}"
        )
    extra = given(keywords)
    if extra and keywords.get("shard_state") in (True, "gradients") and mode.shards_state_as is not None:
        raise TypeError(
            f"mode={mode!r} was given with shard_state={keywords['shard_state']!r} as well: pass both in the mode, "
            f"{mode.shards_state_as}; drop shard_state="
        )
    if extra:
        raise TypeError(
            f"mode={mode!r} was given with the shorthand {', '.join(extra)} as well: pass the mode object or the "
            f"shorthand keywords, not both; drop {', '.join(name.split('=')[0] + '=' for name in extra)} (the mode "
            "object's own arguments say it)"
        )
    return mode


def from_keywords(*, shard_state: Any = False, sync_every: Any = 1, outer_optimizer: Optional[OuterFactory] = None,
                  local_warmup: Any = 0, sync_fragments: Any = None, sync_overlap: Any = None,
                  sync_mixing: Any = None) -> Mode:
    """The mode the flat keyword arguments ask for (None: not given, for the streaming ones).

    Raises:
        TypeError: a keyword of the wrong type (``shard_state`` not a bool or ``"gradients"``, ``sync_every`` not an
            int, an optimizer instance as ``outer_optimizer``, ...).
        ValueError: out of range, a local-SGD keyword without local SGD (``sync_every > 1`` or an
            ``outer_optimizer``), or ``shard_state=True`` with local SGD.
    """
    if not isinstance(shard_state, bool) and shard_state != "gradients":
        raise TypeError(f"shard_state must be True, False or 'gradients' (the gradients sharded too), got "
                        f"{shard_state!r}")
    check_arguments(sync_every, outer_optimizer, local_warmup, None, None, None, outer_required=False,
                    spelling=SPELLING)
    if sync_every <= 1 and outer_optimizer is None:
        needs_local = [(name, value) for name, value in (("local_warmup", local_warmup or None),
                                                         ("sync_fragments", sync_fragments),
                                                         ("sync_overlap", sync_overlap),
                                                         ("sync_mixing", sync_mixing)) if value is not None]
        if needs_local:
            name, value = needs_local[0]
            raise ValueError(
                f"{name}={value!r} needs local SGD: pass sync_every > 1 (or an outer_optimizer), e.g. "
                f"sync_every=16, {name}={value!r}; or drop {name} (with sync_every=1 every step is synchronous)"
            )
        mode: Mode = ShardedState(gradients=shard_state == "gradients") if shard_state else Synchronous()
        mode.given_as = f"shard_state={shard_state!r}" if shard_state else "synchronous training"
        return mode
    if shard_state:
        raise ValueError(
            f"shard_state=True with sync_every={sync_every!r} / outer_optimizer: local SGD steps every parameter "
            "on every rank, so there is no state to shard; use one or the other"
        )
    check_arguments(sync_every, outer_optimizer, local_warmup, sync_fragments, sync_overlap, sync_mixing,
                    outer_required=False, spelling=SPELLING)
    streaming = {"fragments": sync_fragments, "overlap": sync_overlap, "mixing": sync_mixing}
    local: LocalSGD = (LocalSGD(sync_every, warmup=local_warmup, **streaming) if outer_optimizer is None
                       else DiLoCo(sync_every, outer_optimizer, warmup=local_warmup, **streaming))
    local.spelling = SPELLING
    local.given_as = ", ".join(given({"sync_every": sync_every, "outer_optimizer": outer_optimizer,
                                      "local_warmup": local_warmup, "sync_fragments": sync_fragments,
                                      "sync_overlap": sync_overlap, "sync_mixing": sync_mixing}))
    return local


def settings_of(mode: Mode) -> Dict[str, Any]:
    """What the ranks compare of ``mode`` (:meth:`~distopt.modes.base.Mode.settings`), keyed by the shorthand
    keywords whichever way it was asked for, and its class last, as a backstop."""
    return {**_UNSET_SETTINGS, **mode.settings(), "mode": type(mode).__name__}
