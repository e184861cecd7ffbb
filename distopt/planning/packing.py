"""Pack planning, launch ordering and flatten/split: pure logic, no communication.

A *pack* is a group of gradients of one (device, dtype) that travel in one
all-reduce. Everything here is deterministic in its inputs, so every rank that
feeds in the same plan inputs gets the same packs in the same order. The
optimizer only drives these functions; property tests exercise them without
any process group.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "ParamMeta",
    "PackSpec",
    "plan_packs",
    "grouped_by_owner",
    "owner_bounds",
    "LaunchOrder",
    "flatten",
    "split",
    "get_offsets",
    "param_pack_concat",
    "param_pack_split",
]


@dataclass(frozen=True)
class ParamMeta:
    """What planning needs to know of one parameter.

    Args:
        key: the pack key; parameters of different keys never share a pack.
            The optimizer uses ``(str(device), dtype)``.
        numel: number of elements.
        itemsize: bytes per element.
    """

    key: Hashable
    numel: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class PackSpec:
    """One planned pack: its members (parameter indices) and their flat layout.

    ``offsets[j]`` is where member ``j`` starts in the flat buffer; the buffer
    holds ``numel`` elements of gradient data.
    """

    key: Hashable
    members: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numels: Tuple[int, ...]
    numel: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def plan_packs(order: Sequence[int], metas: Sequence[ParamMeta], threshold: int,
               groups: Optional[Sequence[int]] = None) -> List[PackSpec]:
    """Group parameters into packs, in the order their gradients are expected.

    Parameters are taken in ``order``; each joins the open pack of its key, and a
    pack closes (and takes the next place in the plan) as soon as its bytes
    reach ``threshold``. A parameter that reaches ``threshold`` by itself travels
    alone (the open pack of its key stays open), so that it can be sent without
    a copy. Packs still open at the end follow in the order they were opened.
    ``threshold=0`` gives one pack per parameter.

    Args:
        order: every parameter index exactly once, earliest-ready first.
        metas: per-index metadata.
        threshold: pack size in bytes at which a pack closes.
        groups: per index, a group (streaming local SGD's fragment, see
            :mod:`distopt.planning.fragments`); parameters of different groups never share
            a pack, as those of different keys do not, so that a group can be sent on its own.
            None: one group.

    Returns:
        The packs, in launch order.

    Raises:
        ValueError: if ``order`` is not a permutation of ``range(len(metas))``
            or ``threshold`` is negative.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 bytes, got {threshold}")
    if sorted(order) != list(range(len(metas))):
        raise ValueError(
            f"order must list every parameter index 0..{len(metas) - 1} exactly once, got {list(order)}"
        )
    if groups is not None and len(groups) != len(metas):
        raise ValueError(f"groups must give a group for each of the {len(metas)} parameters, got {len(groups)}")
    plan: List[PackSpec] = []
    # Open packs by (key, group): a pack holds one key and one group.
    open_packs: Dict[Hashable, List[int]] = {}
    open_bytes: Dict[Hashable, int] = {}
    for index in order:
        meta = metas[index]
        if meta.nbytes >= threshold:
            plan.append(_make_spec(meta.key, [index], metas))
            continue
        slot = (meta.key, 0 if groups is None else groups[index])
        members = open_packs.setdefault(slot, [])
        members.append(index)
        open_bytes[slot] = open_bytes.get(slot, 0) + meta.nbytes
        if open_bytes[slot] >= threshold:
            plan.append(_make_spec(meta.key, open_packs.pop(slot), metas))
            del open_bytes[slot]
    for (key, _), members in open_packs.items():  # dicts keep opening order
        plan.append(_make_spec(key, members, metas))
    return plan


def grouped_by_owner(specs: Sequence[PackSpec], metas: Sequence[ParamMeta], owners: Sequence[int]) -> List[PackSpec]:
    """The same packs with each pack's members ordered by owner (stably), so that the gradients of
    each rank's parameters lie in one contiguous chunk of the pack: what a reduce-scatter to the
    owners needs (``shard_state="gradients"``). Pure: every rank derives the same layout.

    Args:
        specs: the plan's packs, in launch order.
        metas: every parameter's size.
        owners: each parameter's owning rank, by parameter index.
    """
    return [_make_spec(spec.key, sorted(spec.members, key=lambda i: owners[i]), metas) for spec in specs]


def owner_bounds(spec: PackSpec, owners: Sequence[int], world: int) -> List[int]:
    """Where each rank's chunk of a pack grouped by owner starts, and where the last ends
    (``world + 1`` offsets; an empty chunk where a rank owns no member)."""
    bounds = [0] * (world + 1)
    for i, n in zip(spec.members, spec.numels):
        bounds[owners[i] + 1] += n
    for r in range(world):
        bounds[r + 1] += bounds[r]
    return bounds


def _make_spec(key: Hashable, members: List[int], metas: Sequence[ParamMeta]) -> PackSpec:
    numels = tuple(metas[i].numel for i in members)
    offsets = []
    total = 0
    for n in numels:
        offsets.append(total)
        total += n
    return PackSpec(key, tuple(members), tuple(offsets), numels, total, metas[members[0]].itemsize)


class LaunchOrder:
    """Decides when packs may launch so that every rank launches them identically.

    A pack may launch once all its members are ready *and* every earlier pack
    of the plan has launched; launches therefore follow plan order on every rank
    whatever order gradients arrive in. ``flush()`` launches whatever remains
    (members that never became ready are sent as zeros by the caller).

    Example::

        order = LaunchOrder([2, 1])          # pack 0 has 2 members, pack 1 has 1
        order.ready(0)                        # -> []   (pack 0 still waits for one)
        order.ready(1)                        # -> []   (pack 1 complete, but pack 0 first)
        order.ready(0)                        # -> [0, 1]
    """

    __slots__ = ("_sizes", "_remaining", "_next")

    def __init__(self, pack_sizes: Sequence[int]) -> None:
        self._sizes = list(pack_sizes)
        self._remaining = list(pack_sizes)
        self._next = 0

    def reset(self) -> None:
        """Start a new round: nothing ready, nothing launched."""
        self._remaining = list(self._sizes)
        self._next = 0

    @property
    def launched(self) -> int:
        """How many packs have launched this round."""
        return self._next

    def ready(self, pack: int) -> List[int]:
        """Mark one member of ``pack`` ready; return the packs that may launch now."""
        remaining = self._remaining
        remaining[pack] -= 1
        if pack != self._next or remaining[pack]:
            return []
        start = self._next
        end = start + 1
        while end < len(remaining) and not remaining[end]:
            end += 1
        self._next = end
        return list(range(start, end))

    def flush(self) -> List[int]:
        """Return every pack not launched yet (in plan order) and mark them launched."""
        start, self._next = self._next, len(self._sizes)
        return list(range(start, self._next))


# ---------------------------------------------------------------------------
# flatten / split: the one implementation used by the optimizer and collectives.


def flatten(tensors: Sequence[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """Concatenate tensors of one dtype and device into a 1-D tensor.

    Args:
        tensors: the tensors, all of one dtype and device.
        out: optional 1-D buffer of exactly the total number of elements to fill.

    Returns:
        The flat tensor (``out`` when given).

    Raises:
        ValueError: on an empty list, mixed dtypes/devices, or a wrong-sized ``out``.
    """
    if not tensors:
        raise ValueError("flatten needs at least one tensor, got an empty sequence")
    first = tensors[0]
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                "flatten needs tensors of one dtype and device, got "
                f"{first.dtype}@{first.device} and {t.dtype}@{t.device}; group them by (device, dtype) first"
            )
    total = sum(t.numel() for t in tensors)
    if out is not None and (out.dim() != 1 or out.numel() != total):
        raise ValueError(f"out must be 1-D with {total} elements, got shape {tuple(out.shape)}")
    views = [t.reshape(-1) for t in tensors]
    if out is None:
        return torch.cat(views)
    return torch.cat(views, out=out)


def split(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    """Views of ``flat`` shaped like each tensor of ``like``, in order (the inverse of :func:`flatten`).

    Raises:
        ValueError: if ``flat`` does not hold exactly the elements of ``like``.
    """
    total = sum(t.numel() for t in like)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(
            f"flat must be 1-D with {total} elements to split into {len(like)} tensors, "
            f"got shape {tuple(flat.shape)}"
        )
    out = []
    offset = 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape))
        offset += n
    return out


def get_offsets(shapes: Sequence[Sequence[int]]) -> List[int]:
    """Flat offsets ``[begin0, end0, begin1, end1, ...]`` for tensors of ``shapes`` packed back to back.

    Raises:
        ValueError: a shape has a negative or non-integral size.
    """
    offsets: List[int] = []
    cursor = 0
    for i, shape in enumerate(shapes):
        n = 1
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
                raise ValueError(
                    f"shapes[{i}] = {tuple(shape)} has the size {d!r}; sizes must be integers >= 0, "
                    "e.g. get_offsets([t.shape for t in tensors])"
                )
            n *= int(d)
        offsets.extend((cursor, cursor + n))
        cursor += n
    return offsets


def _check_offsets(offsets: Sequence[int], count: int) -> None:
    if len(offsets) != 2 * count:
        raise ValueError(
            f"offsets must hold a [begin, end] pair per tensor ({2 * count} numbers), got {len(offsets)}; "
            "build them with get_offsets(shapes)"
        )


def param_pack_concat(tensors: Sequence[Tensor], offsets: Sequence[int]) -> Tensor:
    """Pack tensors into one flat tensor laid out as ``offsets`` (see :func:`get_offsets`)."""
    _check_offsets(offsets, len(tensors))
    for i, t in enumerate(tensors):
        if offsets[2 * i + 1] - offsets[2 * i] != t.numel():
            raise ValueError(
                f"offsets give tensor {i} {offsets[2 * i + 1] - offsets[2 * i]} elements but it has "
                f"{t.numel()}; build offsets with get_offsets([t.shape for t in tensors])"
            )
    if list(offsets[0::2]) == [0] + list(offsets[1:-1:2]):  # back to back: one cat
        return flatten(tensors)
    out = tensors[0].new_zeros(max(offsets[1::2], default=0))
    for i, t in enumerate(tensors):
        out[offsets[2 * i] : offsets[2 * i + 1]].copy_(t.reshape(-1))
    return out


def param_pack_split(flat: Tensor, offsets: Sequence[int], shapes: Sequence[Sequence[int]]) -> List[Tensor]:
    """Views of ``flat`` at ``offsets`` with the given ``shapes`` (the inverse of :func:`param_pack_concat`)."""
    _check_offsets(offsets, len(shapes))
    out = []
    for i, shape in enumerate(shapes):
        begin, end = offsets[2 * i], offsets[2 * i + 1]
        if end > flat.numel():
            raise ValueError(f"offsets reach element {end} but flat has only {flat.numel()}")
        out.append(flat[begin:end].view(tuple(shape)))
    return out
