"""The local-SGD modes as the user builds them: :class:`LocalSGD` (periodic model averaging) and :class:`DiLoCo`.

Every rank trains alone, and every ``every`` steps the ranks average their progress since
the last sync: :class:`LocalSGD` takes the mean of the parameters (torch's
``PeriodicModelAverager``, torchft's ``LocalSGD``); :class:`DiLoCo` steps an outer
optimizer on the mean pseudo-gradient (torchft's ``DiLoCo``). Either one, given
``fragments``, ``overlap`` or ``mixing``, is streaming: the model is synced one fragment at
a time, each sync hidden behind inner steps (Douillard et al. 2025).

Each class declares and checks its arguments here; the work is done by the implementation
it derives from, :class:`~distopt.modes.local_sgd.LocalSGDMode` (whole-model syncs) or,
when streaming, :class:`~distopt.modes.streaming.StreamingMode` (a streaming
``LocalSGD(...)`` is a :class:`LocalSGD` whose class also derives from it, as
``pathlib.Path(...)`` builds a ``PosixPath``).
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, Mapping, Optional

from torch.optim import Optimizer

from .base import OuterFactory
from .local_sgd import LocalSGDMode
from .streaming import StreamingMode

__all__ = ["LocalSGD", "DiLoCo", "check_arguments"]

#: An example outer optimizer, for the fixes error messages suggest.
_OUTER_EXAMPLE = "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"


def check_arguments(every: Any, outer: Any, warmup: Any, fragments: Any, overlap: Any, mixing: Any, *,
                    outer_required: bool, spelling: Mapping[str, str] = {}) -> None:
    """Check local SGD's arguments (``fragments``, ``overlap``, ``mixing``: None when not given).

    Args:
        outer_required: DiLoCo's ``outer`` may not be None.
        spelling: argument -> the keyword the user wrote (the shorthands' ``sync_every``, ...).

    Raises:
        TypeError: ``every``/``warmup``/``fragments``/``overlap`` not an int, ``outer`` not a function
            (an optimizer instance, say), ``mixing`` not a number.
        ValueError: out of range: ``every >= 1``, ``warmup >= 0``, ``fragments`` in ``1..every``,
            ``overlap`` in ``0..every - 1``, ``mixing`` in ``[0, 1]``.
    """
    def name(argument: str) -> str:
        return spelling.get(argument, argument)

    for argument, value, least, meaning in (("every", every, 1, "the local steps between two syncs"),
                                            ("warmup", warmup, 0, "0 starts local at once")):
        _whole(value, name(argument), least, meaning, least + 4)
    if isinstance(outer, Optimizer) or (outer is None and outer_required) or (outer is not None and not callable(outer)):
        raise TypeError(
            f"{name('outer')} must be a function that builds the outer optimizer from the tensors it is given, "
            f"got {type(outer).__name__}; pass e.g. {name('outer')}={_OUTER_EXAMPLE}"
        )
    for argument, value, least, meaning in (("fragments", fragments, 1, "1 syncs the whole model at once"),
                                            ("overlap", overlap, 0, "0 waits for each sync at once")):
        if value is not None:
            _whole(value, name(argument), least, meaning, least + 1)
    if fragments is not None and fragments > every:
        raise ValueError(
            f"{name('fragments')}={fragments!r} must be at most {name('every')}={every!r}: each fragment syncs once "
            f"every {name('every')} steps, at a step of its own; pass {name('fragments')} <= {every!r} or a larger "
            f"{name('every')}"
        )
    if overlap is not None and overlap >= every:
        raise ValueError(
            f"{name('overlap')}={overlap!r} must be less than {name('every')}={every!r}: a fragment's sync must "
            f"arrive before the fragment syncs again; pass {name('overlap')} <= {every - 1!r}"
        )
    if mixing is not None:
        if isinstance(mixing, bool) or not isinstance(mixing, numbers.Real):
            raise TypeError(f"{name('mixing')} must be a number in [0, 1], got {mixing!r}; pass e.g. "
                            f"{name('mixing')}=0.5")
        if not 0.0 <= mixing <= 1.0:  # NaN too
            raise ValueError(
                f"{name('mixing')} must be in [0, 1] (the weight of the local parameters when a sync arrives: 0 takes "
                f"the global ones), got {mixing!r}"
            )


def _whole(value: Any, name: str, least: int, meaning: str, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}; pass e.g. {name}={example}")
    if value < least:
        raise ValueError(f"{name} must be an int >= {least} ({meaning}), got {value!r}")


class LocalSGD(LocalSGDMode):
    """Local SGD (periodic model averaging): every rank trains alone, and every ``every`` steps the
    ranks average their parameters.

    Between two syncs no gradient is reduced: each rank steps on its own gradients. At a sync the
    ranks average their progress since the last one, so the parameters become the mean of the
    ranks' (torch's ``PeriodicModelAverager``, with ``warmup`` as its ``warmup_steps``; torchft's
    ``LocalSGD``). The ranks are bitwise identical after every sync. ``sync_every=H`` is its
    shorthand (``local_warmup=``, ``sync_fragments=``, ... for the rest). A mode object serves one
    wrapper.

    Args:
        every: local steps between two syncs (H); 1 averages the parameters after every step.
        warmup: synchronous steps (gradients averaged during backward) before local SGD starts
            (default: 0).
        fragments: streaming: the model is cut into this many fragments of about equal bytes, each
            synced every ``every`` steps at a step of its own (at most ``every``; default: None, 1).
        overlap: streaming: inner steps a fragment's sync travels, hidden behind them, before it is
            applied (less than ``every``; default: None, 0).
        mixing: streaming: when a fragment's sync is applied, the parameters become
            ``mixing * local + (1 - mixing) * global`` (in [0, 1]; default: None, 0.0).

    Raises:
        TypeError: an argument of the wrong type, naming it.
        ValueError: an argument out of range, naming it, its value and the fix; and, when the wrapper
            is built, ``reduce_op="sum"`` or ``bcast_period > 0`` (every sync leaves the ranks
            identical already).

    Example::

        >>> model = Net()
        >>> opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                                    mode=distopt.LocalSGD(every=16, warmup=100))
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()   # local gradients
        ...     opt.step()                        # every 16th step (after 100 synchronous ones) averages
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "LocalSGD":
        streaming = any(kwargs.get(k) is not None for k in ("fragments", "overlap", "mixing"))
        return super().__new__(_STREAMING.get(cls, cls) if streaming else cls)

    def __init__(self, every: int, *, warmup: int = 0, fragments: Optional[int] = None,
                 overlap: Optional[int] = None, mixing: Optional[float] = None) -> None:
        self._configure(every, None, warmup, fragments, overlap, mixing)

    def _configure(self, every: Any, outer: Optional[OuterFactory], warmup: Any, fragments: Any, overlap: Any,
                   mixing: Any) -> None:
        """Check the arguments, keep them (for ``repr``) and set the implementation up."""
        check_arguments(every, outer, warmup, fragments, overlap, mixing, outer_required=isinstance(self, DiLoCo))
        self._arguments: Dict[str, Any] = {"every": every, "warmup": warmup, "fragments": fragments,
                                           "overlap": overlap, "mixing": mixing}
        if isinstance(self, StreamingMode):
            StreamingMode.__init__(self, int(every), outer, int(warmup), int(1 if fragments is None else fragments),
                                   int(0 if overlap is None else overlap), float(0.0 if mixing is None else mixing))
        else:
            LocalSGDMode.__init__(self, int(every), outer, int(warmup))

    def __repr__(self) -> str:
        shown = [f"{k}={v!r}" for k, v in self._arguments.items()
                 if k == "every" or (v is not None and not (k == "warmup" and v == 0))]
        if self._factory is not None:
            shown.insert(1, "outer=...")
        public = {streaming: cls for cls, streaming in _STREAMING.items()}.get(type(self), type(self))
        return f"{public.__name__}({', '.join(shown)})"


class DiLoCo(LocalSGD):
    """DiLoCo (Douillard et al. 2023): local SGD whose syncs step an outer optimizer.

    Every rank trains alone; every ``every`` steps the ranks average their *pseudo-gradients* (the
    parameters at the last sync minus the parameters now), and every rank steps the outer
    optimizer, built by ``outer`` over distopt's copies of the parameters at the last sync, on the
    mean, alike (torchft's ``DiLoCo``). Only the pseudo-gradients travel, so ``compression`` rounds
    the change and the ranks stay bitwise identical after every sync. ``sync_every=H,
    outer_optimizer=...`` is its shorthand. A mode object serves one wrapper.

    Args:
        every: local steps between two syncs (H).
        outer: builds the outer optimizer from the tensors it is given, e.g.
            ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)``.
        warmup: synchronous steps before local SGD starts (default: 0).
        fragments: streaming DiLoCo (Douillard et al. 2025): fragments synced on staggered
            schedules, each every ``every`` steps (at most ``every``; default: None, 1).
        overlap: streaming: inner steps a fragment's sync travels before it is applied (less than
            ``every``; default: None, 0).
        mixing: streaming: the local parameters' weight when a fragment's sync is applied (in
            [0, 1]; default: None, 0.0).

    Raises:
        TypeError: ``outer`` is not a function (an optimizer instance, say), or an argument of the
            wrong type; when the wrapper is built, ``outer`` returned no ``torch.optim.Optimizer``.
        ValueError: as :class:`LocalSGD`; when the wrapper is built, ``outer`` built its optimizer over
            other tensors than those it was given (the model's parameters, say).

    Example::

        >>> model = Net()
        >>> outer = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
        >>> opt = distopt.DistributedOptimizer(
        ...     torch.optim.AdamW(model.parameters(), lr=3e-4),
        ...     mode=distopt.DiLoCo(every=64, outer=outer, fragments=4, overlap=2, mixing=0.75))
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()   # local gradients
        ...     opt.step()                        # a fragment's sync every 16 steps, applied 2 steps later
    """

    def __init__(self, every: int, outer: OuterFactory, *, warmup: int = 0, fragments: Optional[int] = None,
                 overlap: Optional[int] = None, mixing: Optional[float] = None) -> None:
        self._configure(every, outer, warmup, fragments, overlap, mixing)


class _StreamingLocalSGD(LocalSGD, StreamingMode):
    """A :class:`LocalSGD` given ``fragments``, ``overlap`` or ``mixing``: streaming's implementation."""


class _StreamingDiLoCo(DiLoCo, StreamingMode):
    """A :class:`DiLoCo` given ``fragments``, ``overlap`` or ``mixing``: streaming's implementation."""


#: Each public class's streaming form.
_STREAMING = {LocalSGD: _StreamingLocalSGD, DiLoCo: _StreamingDiLoCo}
