"""The drift check's pure part: what it compares, its exact fingerprints, and what a difference means.

A mode says what it keeps identical on every rank at a given moment (:class:`Kept`):
for each of the wrapper's parameters, in tracking order, a few named *items* (the
parameter itself, its optimizer state, local SGD's last-sync copy), and a few
shared ones (the param groups' hyperparameters, the step count). The check then
works in two stages, and only the first runs while the ranks agree:

1. **Fingerprints** (:func:`fingerprints`): one integer per parameter (its items
   together) and one for the shared items, below 2**52 so that each travels exactly
   as a float64. A tensor's part is a hash of its name, shape, dtype and the sum of
   its raw bytes read as int64 words (modulo 2**64); the parts add up. Integer
   addition is associative, so the same bits give the same fingerprint whatever
   the order of the reduction: on any thread count, CPU or GPU. Float sums are not
   so: the float64 sum of squares of the same 10M float32 values differs in its
   last digits between one and two threads on CPU, and a check built on it would
   report drift between identical ranks, or need a tolerance that hides small real
   drift. It is also cheap: an int64 sum of the raw bytes runs at memory speed
   (16 ms for 64 MiB on the 2-core development machine, a float32 sum's 14 ms),
   where a float64 sum of float32 values took 217 ms. A sum misses changes that
   cancel exactly (two elements swapped; every sign of a tensor flipped when it
   holds as many negative values as positive ones, in the right places), which a
   real drift does not do.
2. **Details** (:func:`details`, :func:`compare`), only for the parameters whose
   fingerprints differ: each rank's items with their float64 mean and RMS, which
   say by how much they differ. The *drift* of a tensor is the larger spread over
   the ranks of its mean and of its RMS: in the parameter's units, never more than
   the RMS of the elementwise difference between two ranks' copies (by the
   triangle inequality), and equal to it for a uniform shift (``p.add_(1e-3)`` on
   one rank drifts by 1e-3).

A difference within ``atol + rtol * RMS`` is tolerated (reported, not raised);
with both 0 any difference in the bits counts. Everything here is pure, and
tested without processes; :mod:`distopt.wrapper.drift_check` does the communication.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "ON_DRIFT",
    "MODULUS",
    "PARAMETER",
    "Item",
    "Kept",
    "Detail",
    "Drifted",
    "DriftReport",
    "DriftError",
    "DriftWarning",
    "state_items",
    "hyperparameter_items",
    "fingerprints",
    "details",
    "compare",
    "message",
]

#: ``on_drift=`` values.
ON_DRIFT = ("raise", "warn")
#: Fingerprints are kept modulo this, so that each travels exactly as a float64.
MODULUS = 1 << 52
#: The name of a parameter's own item in :attr:`Kept.per_param`.
PARAMETER = "parameter"

#: ``(what, value)``: a name such as ``"optimizer state 'exp_avg'"`` and a tensor, a number, or a
#: list, tuple or dict of them.
Item = Tuple[str, Any]

# A tensor's bits are summed as int64 words modulo 2**64 (wrapping): the same value however it is
# computed (one sum, or differences of a running sum over many tensors).
_WORDS = 1 << 64
# Tensors up to this many bytes are summed together, one concatenation per device: a sum per
# tensor would cost its dispatch (~7 us) for a few bytes; beyond 16 KiB the cumulative sum over the
# concatenation costs more than it saves (mlp and transformer workloads, one thread).
_SMALL_BYTES = 1 << 14


@dataclass
class Kept:
    """What a mode keeps identical on every rank at this moment, as the drift check compares it.

    Attributes:
        per_param: for each of the wrapper's parameters, in tracking order, its items
            (the parameter itself is :data:`PARAMETER`; optimizer state, a last-sync copy).
        shared: items of no parameter (hyperparameters, the step count).
        what: what is compared, in words, for reports.
    """

    per_param: List[List[Item]]
    shared: List[Item] = field(default_factory=list)
    what: str = "the parameters"

    @property
    def compared(self) -> int:
        """Items compared (a container counts once)."""
        return sum(len(items) for items in self.per_param) + len(self.shared)


@dataclass(frozen=True)
class Detail:
    """One item (a leaf of a container counts alone) on one rank, as the ranks exchange it when
    fingerprints differ.

    Attributes:
        what: the item's name within its parameter (or a shared item's full name).
        kind: ``"tensor"``, ``"number"`` or ``"other"``.
        bits: its exact fingerprint (a hash of its bits' sum, name, shape and dtype).
        shape: a tensor's shape.
        dtype: a tensor's dtype.
        mean: a tensor's float64 mean, or a number's value.
        rms: a tensor's float64 root mean square, or a number's absolute value.
        text: how an item of another kind reads (``repr`` of a str or None, else its type).
    """

    what: str
    kind: str
    bits: int
    shape: Tuple[int, ...] = ()
    dtype: str = ""
    mean: float = 0.0
    rms: float = 0.0
    text: str = ""


@dataclass(frozen=True)
class Drifted:
    """One item that differs between ranks.

    Attributes:
        name: the item's full name (``"parameter '0.weight'"``, ``"optimizer state 'exp_avg' of '0.weight'"``).
        drift: how much it differs (see the module); ``inf`` when it differs in kind, shape or
            presence, or is not finite on some rank.
        scale: its size, what ``rtol`` multiplies (the largest RMS, or absolute value, over the ranks).
        beyond: beyond the tolerance.
        how: how it differs, rank by rank.
        is_parameter: a parameter itself (what a parameter broadcast corrects).
        shared: an item of no parameter (a hyperparameter, the step count), often the cause
            of the parameters' drift.
    """

    name: str
    drift: float
    scale: float
    beyond: bool
    how: str
    is_parameter: bool
    shared: bool = False


@dataclass
class DriftReport:
    """What one drift check found; ``opt.check_drift()`` returns it, and ``opt.stats`` holds its figures.

    Attributes:
        step: the wrapper's step count at the check.
        compared: tensors and values compared.
        drifted: those that differ between ranks, in parameter order, then the shared ones.
        what: what was compared, in words.
        corrected: None, or (the check ran right before a ``bcast_period`` re-broadcast) the
            largest parameter drift that re-broadcast overwrote; 0.0 when there was none.
    """

    step: int
    compared: int = 0
    drifted: List[Drifted] = field(default_factory=list)
    what: str = "the parameters"
    corrected: Optional[float] = None

    @property
    def drift(self) -> float:
        """The largest drift found; 0.0 when the ranks agree bit for bit."""
        return max((d.drift for d in self.drifted), default=0.0)

    @property
    def name(self) -> str:
        """What the largest drift was found in; ``""`` when nothing differs."""
        return max(self.drifted, key=lambda d: d.drift).name if self.drifted else ""

    @property
    def beyond(self) -> List[Drifted]:
        """The differences beyond the tolerance, the first first."""
        return [d for d in self.drifted if d.beyond]

    @property
    def parameter_drift(self) -> float:
        """The largest drift of a parameter itself (what a parameter broadcast corrects)."""
        return max((d.drift for d in self.drifted if d.is_parameter), default=0.0)


class DriftError(RuntimeError):
    """The ranks' copies of what the mode keeps identical differ beyond the tolerance.

    Every rank raises it with the same text. Attributes: ``report``, the :class:`DriftReport`.
    """

    def __init__(self, text: str, report: DriftReport) -> None:
        super().__init__(text)
        self.report = report


class DriftWarning(UserWarning):
    """What :class:`DriftError` says, as a warning (``on_drift="warn"``); training goes on."""


# ---------------------------------------------------------------------- what a mode keeps identical

def state_items(optimizer: Optimizer, keys: Sequence[Optional[Tensor]], label: str) -> List[List[Item]]:
    """Each tensor's optimizer state, as items named ``f"{label} {key!r}"``.

    Args:
        optimizer: whose ``state`` to read (it is not changed: no entry is created).
        keys: the tensors the state is keyed by, one per parameter (None: none).
        label: what to call it, e.g. ``"optimizer state"``.
    """
    state = optimizer.state
    out: List[List[Item]] = []
    for key in keys:
        entry = state.get(key) if key is not None else None
        out.append([] if not entry else [(f"{label} {k!r}", v) for k, v in sorted(entry.items(), key=_by_repr)])
    return out


def hyperparameter_items(optimizer: Optimizer, label: str = "param_groups") -> List[Item]:
    """Every param group's entries but ``params`` (lr, betas, ...), named ``f"{label}[g]['lr']"``."""
    return [(f"{label}[{g}][{key!r}]", group[key])
            for g, group in enumerate(optimizer.param_groups)
            for key in sorted((k for k in group if k != "params"), key=repr)]


def _by_repr(pair: Tuple[Any, Any]) -> str:
    return repr(pair[0])


# ---------------------------------------------------------------------- stage 1: fingerprints

def fingerprints(kept: Kept) -> List[int]:
    """One exact fingerprint per parameter of ``kept``, then one of its shared items, each in ``[0, MODULUS)``.

    Small tensors are summed together, one concatenation per device; every sum stays on its
    device until one copy to the host per device.
    """
    slots = list(kept.per_param) + [kept.shared]
    totals = [0] * len(slots)
    tensors: List[Tuple[int, str, Tensor]] = []
    for slot, items in enumerate(slots):
        for what, value in items:
            for leaf, v in _leaves(what, value):
                if isinstance(v, Tensor):
                    tensors.append((slot, leaf, v))
                else:
                    totals[slot] += _hash(leaf, *_scalar(v))
    for (slot, leaf, t), word_sum in zip(tensors, _word_sums([t for _, _, t in tensors])):
        totals[slot] += _hash(leaf, "tensor", tuple(t.shape), t.dtype, word_sum)
    return [t % MODULUS for t in totals]


def _leaves(what: str, value: Any) -> List[Tuple[str, Any]]:
    """``value``'s leaves, named: a list, tuple or dict is opened (LBFGS keeps lists of tensors)."""
    if isinstance(value, (list, tuple)):
        return [(f"{what} (a {type(value).__name__} of {len(value)})", len(value))] + [
            leaf for i, v in enumerate(value) for leaf in _leaves(f"{what}[{i}]", v)]
    if isinstance(value, dict):
        return [(f"{what} (a dict of {len(value)})", len(value))] + [
            leaf for k, v in sorted(value.items(), key=_by_repr) for leaf in _leaves(f"{what}[{k!r}]", v)]
    return [(what, value)]


def _word_sums(tensors: Sequence[Tensor]) -> List[int]:
    """Each tensor's bytes, zero-padded to a multiple of 8, as int64 words summed modulo 2**64.

    The same bits give the same sum, whatever the layout, the device or the order of the
    additions. Summed as int64 pairs rather than 32-bit words: a 32-bit sum of a float32
    tensor doubled on one rank moves by ``n * 2**23``, nothing modulo 2**32 once ``n`` is a
    multiple of 512, and an exact int64 sum of int32 words runs ten times slower on CPU.
    """
    sums: List[int] = [0] * len(tensors)
    small: Dict[torch.device, Tuple[List[int], List[int], List[Tensor]]] = defaultdict(lambda: ([], [0], []))
    large: Dict[torch.device, Tuple[List[int], List[Tensor]]] = defaultdict(lambda: ([], []))
    for k, t in enumerate(tensors):
        raw = _bytes(t)
        n = raw.numel()
        if n <= _SMALL_BYTES:
            owners, ends, pieces = small[raw.device]
            owners.append(k)
            ends.append(ends[-1] + (n + 7) // 8)
            pieces.append(raw)
            if n % 8:
                pieces.append(raw.new_zeros(8 - n % 8))
        else:
            owners, parts = large[raw.device]
            owners.append(k)
            parts.append(_int64_words(raw).sum())
    for owners, parts in large.values():
        for k, total in zip(owners, torch.stack(parts).tolist()):
            sums[k] = total % _WORDS
    for owners, ends, pieces in small.values():
        # Each tensor's sum is the difference of the running sum (int64, wrapping) at its two ends.
        words = torch.cat(pieces).view(torch.int64)
        running = torch.cat([words.new_zeros(1), words.cumsum(0)])
        at = running[torch.tensor(ends, device=running.device)].tolist()
        for j, k in enumerate(owners):
            sums[k] = (at[j + 1] - at[j]) % _WORDS
    return sums


def _bytes(t: Tensor) -> Tensor:
    """``t``'s raw bytes, its elements in their logical order: a word pairs two float32 elements, so
    the order matters, and a layout that differs between ranks (a checkpoint loaded on one rank)
    must not read as drift. A tensor stored in another order (``channels_last``) is copied for it."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8)


def _int64_words(raw: Tensor) -> Tensor:
    """The bytes ``raw`` as int64 words, the last one zero-padded."""
    whole = raw.numel() // 8 * 8
    if whole != raw.numel():
        raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
    try:
        return raw.view(torch.int64)
    except RuntimeError:  # bytes at an offset that is not a multiple of 8
        return raw.clone().view(torch.int64)


def _scalar(value: Any) -> Tuple[str, int, str]:
    """``(kind, exact bits, text)`` of a value that is not a tensor."""
    if isinstance(value, bool) or isinstance(value, numbers.Integral):
        return "number", int(value), ""
    if isinstance(value, numbers.Real):
        return "number", struct.unpack("<q", struct.pack("<d", float(value)))[0], ""
    if value is None or isinstance(value, (str, bytes, complex)):
        text = repr(value)
    else:  # an object's repr may hold its address, which differs between processes
        text = f"a {type(value).__name__}"
    return "other", 0, text


def _hash(*parts: Any) -> int:
    """A hash of ``parts`` that is the same in every process (``hash()`` of a str is salted per process),
    below :data:`MODULUS`: an item's fingerprint, so that any change of its bits changes it all."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MODULUS


# ---------------------------------------------------------------------- stage 2: what differs, by how much

def details(kept: Kept, slot: int) -> List[Detail]:
    """The items of parameter ``slot`` of ``kept`` (``len(kept.per_param)``: the shared ones), with their moments."""
    items = kept.per_param[slot] if slot < len(kept.per_param) else kept.shared
    out = []
    for what, value in items:
        for leaf, v in _leaves(what, value):
            if isinstance(v, Tensor):
                x = v.detach()
                bits = _hash(leaf, "tensor", tuple(x.shape), x.dtype, _word_sums([x])[0])
                mean, rms = _moments(x)
                out.append(Detail(leaf, "tensor", bits, tuple(x.shape), str(x.dtype).replace("torch.", ""), mean, rms))
            else:
                kind, bits, text = _scalar(v)
                number = float(v) if kind == "number" else 0.0
                out.append(Detail(leaf, kind, _hash(leaf, kind, bits, text), mean=number, rms=abs(number), text=text))
    return out


def _moments(t: Tensor) -> Tuple[float, float]:
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.numel() == 0:
        return 0.0, 0.0
    x = t.to(torch.float64)
    return x.mean().item(), x.square().mean().sqrt().item()


def compare(everyone: Sequence[Dict[int, List[Detail]]], names: Sequence[str], atol: float,
            rtol: float) -> List[Drifted]:
    """What differs between the ranks' details, and whether beyond ``atol + rtol * scale``.

    Args:
        everyone: per rank, the details of the parameters whose fingerprints differ, by slot.
        names: each parameter's name, by slot (the shared items are named alone).
        atol: the absolute tolerance.
        rtol: the relative tolerance.

    Returns:
        The items that differ, by slot, in the first rank's item order (then items that rank lacks).
    """
    found = []
    for slot in sorted(everyone[0]):
        per_rank = [{d.what: d for d in theirs.get(slot, [])} for theirs in everyone]
        order = list(dict.fromkeys(what for ranked in per_rank for what in ranked))
        owner = names[slot] if slot < len(names) else None
        for what in order:
            drifted = _compare_item(_full_name(what, owner), [ranked.get(what) for ranked in per_rank], atol, rtol,
                                    what == PARAMETER and owner is not None, owner is None)
            if drifted is not None:
                found.append(drifted)
    return found


def _full_name(what: str, owner: Optional[str]) -> str:
    if owner is None:
        return what
    return f"parameter {owner!r}" if what == PARAMETER else f"{what} of {owner!r}"


def _compare_item(name: str, ranked: List[Optional[Detail]], atol: float, rtol: float,
                  is_parameter: bool, shared: bool) -> Optional[Drifted]:
    ranks = range(len(ranked))
    missing = [r for r in ranks if ranked[r] is None]
    if missing:
        present = [r for r in ranks if ranked[r] is not None]
        return Drifted(name, math.inf, math.inf, True,
                       f"exists on {_ranks(present)} but not on {_ranks(missing)}", is_parameter, shared)
    details_: List[Detail] = [d for d in ranked if d is not None]
    if len({d.bits for d in details_}) == 1:
        return None
    first = details_[0]
    if any((d.kind, d.shape, d.dtype) != (first.kind, first.shape, first.dtype) for d in details_):
        how = ", ".join(f"{_kind(d)} on rank {r}" for r, d in enumerate(details_))
        return Drifted(name, math.inf, math.inf, True, f"is {how}", is_parameter, shared)
    if first.kind == "other":
        how = ", ".join(f"{d.text} on rank {r}" for r, d in enumerate(details_))
        return Drifted(name, math.inf, math.inf, True, f"is {how}", is_parameter, shared)
    means = [d.mean for d in details_]
    rmss = [d.rms for d in details_]
    if all(math.isfinite(v) for v in means + rmss):
        drift, scale = max(max(means) - min(means), max(rmss) - min(rmss)), max(rmss)
    else:  # an inf or a NaN on some rank: no tolerance covers it
        drift = scale = math.inf
    bound = atol + rtol * scale
    beyond = drift > bound or bound == 0 or not math.isfinite(bound)
    if first.kind == "number":
        how = f"is {_per_rank(means)}"
    elif drift == 0:
        how = ("differs in its bits only: its mean and RMS agree to float64 precision "
               f"(mean {means[0]:.9g}, RMS {rmss[0]:.9g})")
    else:
        how = f"has mean {_per_rank(means)}; RMS {_per_rank(rmss)}"
    return Drifted(name, drift, scale, beyond, how, is_parameter, shared)


def _kind(d: Detail) -> str:
    if d.kind == "tensor":
        return f"a tensor of shape {list(d.shape)} {d.dtype}"
    return "a number" if d.kind == "number" else d.text


def _per_rank(values: List[float]) -> str:
    """``0.1 on rank 0, 0.2 on rank 1``; in a larger world only the extremes, with their ranks."""
    if len(values) <= 4:
        return ", ".join(f"{v:.9g} on rank {r}" for r, v in enumerate(values))
    lo = min(range(len(values)), key=values.__getitem__)
    hi = max(range(len(values)), key=values.__getitem__)
    return f"from {values[lo]:.9g} (rank {lo}) to {values[hi]:.9g} (rank {hi})"


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# ---------------------------------------------------------------------- the text every rank raises or warns

def message(report: DriftReport, *, when: str, atol: float, rtol: float, on_drift: str,
            root: int, bcast_period: int) -> str:
    """What :class:`DriftError` (or the warning) says about ``report``: the first item beyond the
    tolerance, by how much, what else differs, when it was found, and what to do.

    Args:
        report: the check's findings, with at least one item beyond the tolerance.
        when: when the check ran, in words (``"after step 10 (check_every=10)"``).
        atol: ``drift_atol``.
        rtol: ``drift_rtol``.
        on_drift: ``"raise"`` or ``"warn"``.
        root: the rank whose parameters a re-broadcast sends.
        bcast_period: the wrapper's ``bcast_period``.
    """
    first = report.beyond[0]
    size = "" if math.isinf(first.drift) else f" by {first.drift:.3g}"
    text = (f"the ranks drifted apart: {first.name} differs between ranks{size}: it {first.how}"
            + ("" if math.isinf(first.drift) else
               f", beyond the tolerance drift_atol={atol:g} + drift_rtol={rtol:g} x {first.scale:.3g}"))
    others = [d for d in report.drifted if d is not first]
    if others:
        largest = max(report.drifted, key=lambda d: d.drift)
        text += (f". {len(report.drifted)} of the {report.compared} tensors and values compared differ "
                 f"(also {_names(others)}); the largest drift is {largest.drift:.3g}, in {largest.name}")
    # A hyperparameter or a step count that differs explains the parameters' drift: say it whole.
    causes = [d for d in others if d.shared]
    if causes:
        text += ". Perhaps the cause: " + "; ".join(f"{d.name} {d.how}" for d in causes[:3])
    text += f". Found by the drift check {when}, which compares {report.what}"
    state_drift = any(not d.is_parameter for d in report.drifted)
    if report.corrected is not None:
        text += (f". That re-broadcast (bcast_period={bcast_period}) then gave every rank rank {root}'s "
                 f"parameters: it corrected a parameter drift of {report.corrected:.3g}")
        if state_drift:
            text += (f"; it does not send the rest (optimizer state, hyperparameters): "
                     f"opt.broadcast_optimizer_state() gives every rank rank {root}'s")
    text += (". Look for code that changes them on some ranks only (a branch on the rank, a checkpoint "
             "loaded on one rank without opt.broadcast_parameters() and opt.broadcast_optimizer_state(), an "
             "LR scheduler stepped on one rank); if the difference is floating-point noise (ranks on different "
             "hardware, nondeterministic kernels), allow it with drift_atol= or drift_rtol=")
    if on_drift == "raise":
        text += ", or pass on_drift='warn' to be warned and train on"
    return text


def _names(drifted: List[Drifted]) -> str:
    drifted = sorted(drifted, key=lambda d: not d.shared)  # stable: the shared ones first, the rest in order
    shown = ", ".join(d.name for d in drifted[:3])
    return shown + (f" and {len(drifted) - 3} more" if len(drifted) > 3 else "")
