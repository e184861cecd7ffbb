"""Error feedback's state: what each parameter's values still owe the sum, kept per rank.

A compressor that sends less than its values (a rounding, a selection, a low-rank
approximation) keeps what it left out as a *residual* and adds it to the parameter's
next values, so errors are delayed, never dropped. A residual is kept in *applied
units*, what it amounts to once the engine has multiplied a round's sum by its factor
(the mean over the ranks that contributed, :mod:`distopt.compression.protocol`), so a
value left out while one number of ranks contributed is applied at that round's mean
whenever it is sent. Residuals are keyed by
``(exchange, parameter index)``: gradients and a mode's exchanges (local SGD's
pseudo-gradients) keep theirs apart, and the index is stable for the wrapper's life.

:class:`PackResiduals` keeps one pack's residuals as views of one padded buffer, so a
codec adds a whole pack's values to its residuals in one pass; the compressor's dict
keeps the views, so a re-plan, a resume or a change of the world takes them over.

A codec with error feedback, in the order of a round (the built-in ``Quantize`` and the
sign compressor follow it; :mod:`distopt.compression.protocol` says why)::

    residual = self.residuals.buffer(round.exchange, padded, data.device)  # PackResiduals
    if round.contributing:
        fold_residual(residual, data, round)    # residual := data + residual / round.factor
        sent = encode(residual)                 # what travels, decoded: its own part of the sum
        residual -= sent                        # what it left out, in this round's units
    yield AllGather(...)                        # the flags are back: round.outcome is filled in
    if round.contributing:
        settle_residual(residual, data, round, lambda: sent)  # back to applied units
    if the gathered bytes hold a non-finite value:
        residual.zero_()                        # every rank sees the same bytes: all drop alike

and the compressor keeps ``residuals`` and ``loads`` (:class:`ResidualOwner`), lists
``"residuals"`` in ``per_rank_keys``, and saves and loads them with :func:`keyed_state` and
:func:`load_residuals`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Protocol, Tuple

import torch
from torch import Tensor

from .protocol import PackLayout, Round

__all__ = ["Key", "state_key", "parse_state_key", "keyed_state", "load_keyed_state", "load_residuals",
           "ResidualOwner", "PackResiduals", "fold_residual", "settle_residual"]

#: ``(exchange, parameter index)``: whose residual, and for which kind of values.
Key = Tuple[bool, int]


def state_key(key: Key) -> str:
    """The text a residual is saved under in a state dict: ``"grad:3"`` or ``"exchange:3"``."""
    return f"{'exchange' if key[0] else 'grad'}:{key[1]}"


def parse_state_key(text: str, owner: str) -> Key:
    """The key :func:`state_key` wrote.

    Raises:
        ValueError: ``text`` is not such a key; the message names ``owner`` (the compressor's class).
    """
    kind, _, index = text.partition(":")
    if kind not in ("exchange", "grad") or not index.isdigit():
        raise ValueError(f"not a {owner} state key: {text!r}")
    return kind == "exchange", int(index)


def keyed_state(tensors: Mapping[Key, Tensor]) -> Dict[str, Tensor]:
    """Copies of per-parameter tensors (residuals, PowerSGD's ``Q``), under text keys, for a checkpoint."""
    return {state_key(k): v.clone() for k, v in tensors.items()}


def load_keyed_state(state: Mapping[str, Tensor], owner: str) -> Dict[Key, Tensor]:
    """The tensors :func:`keyed_state` saved (copies).

    Raises:
        ValueError: a key that is not one :func:`state_key` writes, naming ``owner``.
    """
    return {parse_state_key(text, owner): value.clone() for text, value in state.items()}


def load_residuals(state_dict: Mapping[str, Any], owner: str) -> Dict[Key, Tensor]:
    """The residuals in a compressor's ``state_dict()`` that holds nothing else (``{"residuals": ...}``).

    Raises:
        ValueError: another key, or a key that is not a residual's; the message names ``owner``.
    """
    unknown = set(state_dict) - {"residuals"}
    if unknown:
        raise ValueError(f"not a {owner} state: unexpected keys {sorted(unknown)}")
    return load_keyed_state(state_dict.get("residuals", {}), owner)


class ResidualOwner(Protocol):
    """A compressor whose codecs keep residuals in :class:`PackResiduals`."""

    #: (exchange, parameter index) -> its residual.
    residuals: Dict[Key, Tensor]
    #: ``load_state_dict()`` calls so far: a codec that sees it change takes the loaded residuals.
    loads: int


class PackResiduals:
    """One pack's residuals, as views of one padded float32 buffer per kind of values.

    The owner's dict keeps the views, and what it holds already (an earlier plan's, a loaded
    state's, this pack's at another padding) is copied in when a buffer is made.

    Args:
        layout: the pack.
        owner: the compressor, whose ``residuals`` and ``loads`` are read at each :meth:`buffer`.
    """

    def __init__(self, layout: PackLayout, owner: ResidualOwner) -> None:
        self.layout = layout
        self.owner = owner
        self._loads = owner.loads
        self._buffers: Dict[bool, Tensor] = {}

    def buffer(self, exchange: bool, padded: int, device: torch.device) -> Tensor:
        """The pack's residual for this kind of values, ``padded`` long (zeros past the members)."""
        owner = self.owner
        if self._loads != owner.loads:  # a loaded state replaced the owner's residuals
            self._buffers.clear()
            self._loads = owner.loads
        buffer = self._buffers.get(exchange)
        if buffer is not None and buffer.numel() == padded:
            return buffer
        # The padding's share is dropped with a buffer of another size: it holds errors of values no rank reads.
        buffer = self._buffers[exchange] = torch.zeros(padded, dtype=torch.float32, device=device)
        for index, shape, offset in zip(self.layout.members, self.layout.shapes, self.layout.offsets):
            view = buffer[offset:offset + shape.numel()].view(shape)
            old = owner.residuals.get((exchange, index))
            if old is not None:
                view.copy_(old)
            owner.residuals[(exchange, index)] = view
        return buffer


def fold_residual(residual: Tensor, data: Tensor, round: Round) -> None:
    """A contributor's values plus its residual, in the residual's storage, before its first collective.

    ``residual`` is kept in applied units; this round's sum is applied at the factor the engine
    expects (:attr:`Round.factor`), so it becomes ``data + residual / round.factor`` (in place:
    its first ``data.numel()`` values take ``data``, the padding past them keeps its own).

    Args:
        residual: float32, at least as long as ``data``.
        data: the pack's values, as :meth:`~distopt.compression.protocol.Codec.reduce` got them.
        round: the round (only a contributor calls this: a rank that does not contribute sends
            zeros and keeps its residual as it is).
    """
    if round.factor != 1.0:
        residual.div_(round.factor)
    residual[:data.numel()].add_(data)


def settle_residual(residual: Tensor, data: Tensor, round: Round, sent: Callable[[], Tensor]) -> None:
    """A contributor's residual back in applied units, once the round's factor is known.

    Called after the codec's first collective (when :attr:`Round.outcome` is filled in), with
    ``residual`` holding ``data + old / round.factor - sent``, what :func:`fold_residual` made
    less what this rank sent. It becomes ``old + round.final_factor * (data - sent)``: every value
    left out is applied once, at the factor of the round that left it out (the protocol's module).
    Outside join blocks both factors are 1 and nothing changes.

    Args:
        residual: as above, float32, at least as long as ``data``.
        data: this rank's values, still as the codec got them (before it writes the sum there).
        round: the round, its outcome filled in.
        sent: what this rank sent, decoded, as long as ``residual``; asked for only in the round
            in which a rank joins (the two factors differ).
    """
    expected, factor = round.factor, round.final_factor
    if expected == 1.0 and factor == 1.0:
        return
    residual.mul_(expected)
    if factor != expected:  # a rank joined in this round: the residual grows by factor * (values - sent)
        residual[:data.numel()].add_(data, alpha=factor - expected)
        residual.add_(sent(), alpha=expected - factor)
