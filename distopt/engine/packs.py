"""Pack buffers: where gradients live while they are averaged.

A :class:`Pack` is the runtime side of one planned :class:`distopt.planning.packing.PackSpec`:
a persistent flat buffer holding its members' gradients, then one presence flag
per member, then the control flags of :mod:`distopt.planning.control`. Each member's
``.grad`` becomes a view of its slice, so the averaged result is the gradient
and nothing is copied back. :func:`gather` moves
the gradients in (scaled by the mean's 1/world in the same pass) and says in
plain words what went wrong when the model or the backward call changed under
the wrapper.

A compressed pack sends its values through the compressor's codec
(:mod:`distopt.compression`), or as a 16-bit copy (``wire``) for a plain cast: of the
whole buffer, flags included, where it is all-reduced; of its values alone where it is
reduce-scattered to the owners (its flags then travel apart, exactly).

A *direct* pack holds one large gradient (at least :data:`DIRECT_MIN_BYTES`, sent
uncompressed). It has no buffer for it: the gradient autograd made is scaled and
all-reduced in place, and only its presence and control flags travel in a small
tensor of their own, in a second all-reduce. That saves a persistent copy of the
gradient (memory) and the copy into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from ..compression.protocol import Codec, Compressor, PackLayout
from ..planning.control import CONTROL_FLAGS
from ..planning.packing import PackSpec, ParamMeta, grouped_by_owner, owner_bounds, plan_packs
from .carrier import Carrier
from .sparse_rows import RowSparse

__all__ = ["Pack", "DIRECT_MIN_BYTES", "layout_of", "build_packs", "adopt_current_grads", "gather", "gather_nothing", "scratch", "send_in_place",
           "release", "gather_early", "metas", "sums", "probe_copy", "onto_wire", "off_wire", "wire_chunks"]

#: Bytes from which a pack of one gradient sends that gradient itself: below it, the flags'
#: extra all-reduce would cost more than the copy saves.
DIRECT_MIN_BYTES = 1 << 20

# Mean member size (elements) under which a pack is gathered with one fused copy: below it the
# per-tensor dispatch cost dominates; above it one fused copy-and-scale pass per tensor wins.
_BATCH_GATHER_BELOW = 1 << 12

_CREATE_GRAPH = (
    "backward(create_graph=True) made gradients that require grad, and a DistributedOptimizer averages "
    "gradients as plain tensors; for a gradient penalty take torch.autograd.grad(..., create_graph=True) "
    "yourself, add the penalty to the loss and call loss.backward() without create_graph"
)


@dataclass
class Pack:
    """Runtime state of one planned pack: a persistent flat buffer the gradients live in."""

    spec: PackSpec
    buffer: Tensor  # gradient data, one presence flag per member, then the control flags (direct: the flags)
    data: Tensor  # the gradient part of ``buffer`` (direct: the gradient itself, set at each launch)
    views: List[Tensor]  # per member, shaped like its parameter; these become ``.grad``
    flags: Tensor  # presence and control flags
    params: List[Tensor]  # the members' parameters
    names: List[str]  # the members' names, for errors
    batched: bool  # small members: gather with one fused copy instead of one copy each
    # 16-bit copy sent instead of ``buffer`` when casting (compression="fp16"); reduce-scattered: of ``data`` only
    wire: Optional[Tensor]
    absent: List[int]  # members that had no local gradient this round
    direct: bool = False  # one large gradient, all-reduced where autograd left it
    moved: Set[int] = field(default_factory=set)  # members moved in by their hook this round
    rows: Optional[RowSparse] = None  # direct packs whose gradient may travel as its non-zero rows
    gathers: Set[int] = field(default_factory=set)  # bytes of the sums it sends as a gather (rounds.plan_gathers)
    # Room for the other ranks' copies of each of those sums, by (whether it is the flags, numel, dtype): a
    # direct pack's gradient and its flags are gathered at once, and may be of one size.
    copies: Dict[Tuple[bool, int, torch.dtype], Tensor] = field(default_factory=dict)
    # The compressor's codec for the values (the flags travel exactly, apart or in its first all-gather), or None.
    codec: Optional[Codec] = None
    # The buffers of the codec's first all-gather when it carries the flags (distopt.engine.carrier).
    carrier: Optional[Carrier] = None
    # Reduce-scattered to the owners (shard_state="gradients"): each rank's chunk of ``data``, in rank order.
    chunks: Optional[List[Tensor]] = None
    # A direct pack reduced to its member's owner alone (shard_state="gradients"), or None.
    owner: Optional[int] = None
    # Room for the other ranks' copies of this rank's chunk of a reduce-scatter, kept from round to round.
    scattered: Optional[Tensor] = None


def sums(pack: Pack) -> List[int]:
    """Bytes of each sum the pack sends in a round: its buffer, or a direct pack's gradient and flags."""
    if pack.direct:
        return [pack.spec.nbytes, pack.flags.numel() * pack.flags.element_size()]
    if pack.codec is not None or pack.chunks is not None:  # the values' collectives are the codec's, or a scatter
        return [pack.flags.numel() * pack.flags.element_size()]
    sent = pack.buffer if pack.wire is None else pack.wire
    return [sent.numel() * sent.element_size()]


def onto_wire(pack: Pack) -> None:
    """Cast what a cast pack sends into its wire copy: the buffer, or its values alone where it is
    reduce-scattered (its flags travel apart, exactly). Nothing for a pack sent as it is."""
    if pack.wire is not None:
        pack.wire.copy_(pack.buffer if pack.chunks is None else pack.data)


def off_wire(pack: Pack) -> None:
    """Take an all-reduced cast pack's sum, flags included, off the wire into its buffer. Nothing for a
    reduce-scattered one: the owner's chunk was summed into the buffer as its parts arrived, and its flags
    never left the buffer."""
    if pack.wire is not None and pack.chunks is None:
        pack.buffer.copy_(pack.wire)


def wire_chunks(pack: Pack, chunks: Sequence[Tensor]) -> List[Tensor]:
    """The chunks of a reduce-scattered cast pack's wire copy lying where ``chunks`` (of its buffer) lie."""
    base = pack.buffer.storage_offset()
    return [pack.wire[c.storage_offset() - base:c.storage_offset() - base + c.numel()] for c in chunks]


def metas(params: Sequence[Tensor]) -> List[ParamMeta]:
    """What planning needs of each parameter; the key is ``(device, dtype)``."""
    return [ParamMeta((p.device, p.dtype), p.numel(), p.element_size()) for p in params]


def layout_of(spec: PackSpec, params: Sequence[Tensor], names: Sequence[str]) -> PackLayout:
    """What a compressor is told of the pack ``spec``."""
    device, dtype = spec.key
    return PackLayout(members=tuple(spec.members), names=tuple(names[i] for i in spec.members),
                      shapes=tuple(params[i].shape for i in spec.members), offsets=tuple(spec.offsets),
                      numel=spec.numel, dtype=dtype, device=device)


def build_packs(params: Sequence[Tensor], names: Sequence[str], order: Sequence[int], threshold: int,
                compressor: Optional[Compressor], groups: Optional[Sequence[int]] = None,
                owners: Optional[Sequence[int]] = None, world: int = 1) -> List[Pack]:
    """Allocate the packs of the plan for ``params`` taken in ``order``, each with its codec if compressed
    (packs never mix ``groups``: see :func:`distopt.planning.packing.plan_packs`). With ``owners`` (each
    parameter's owning rank of ``world``), every pack's members are grouped by owner, and it is
    reduce-scattered to them (:attr:`Pack.chunks`; a direct pack to its one member's :attr:`Pack.owner`)."""
    packs = []
    specs = plan_packs(order, metas(params), threshold, groups)
    if owners is not None:
        specs = grouped_by_owner(specs, metas(params), owners)
    for spec in specs:
        device, dtype = spec.key
        first = params[spec.members[0]]
        wire_dtype = codec = None
        if compressor is not None:
            wire_dtype = compressor.wire_dtype(dtype)
            if wire_dtype is None:
                codec = compressor.codec(layout_of(spec, params, names))
        if (len(spec.members) == 1 and spec.nbytes >= DIRECT_MIN_BYTES and first.is_contiguous()
                and wire_dtype is None and codec is None):
            flags = torch.empty(1 + CONTROL_FLAGS, dtype=dtype, device=device)
            packs.append(Pack(spec, flags, flags[:0], [], flags, [first], [names[spec.members[0]]], False, None, [],
                              direct=True, owner=None if owners is None else owners[spec.members[0]]))
            continue
        buffer = torch.empty(spec.numel + len(spec.members) + CONTROL_FLAGS, dtype=dtype, device=device)
        views = [buffer[off : off + n].view(params[i].shape) for i, off, n in zip(spec.members, spec.offsets, spec.numels)]
        wire = None
        if wire_dtype is not None:  # reduce-scattered, the flags travel apart: the values alone are cast
            wire = torch.empty(buffer.numel() if owners is None else spec.numel, dtype=wire_dtype, device=device)
        batched = spec.numel < _BATCH_GATHER_BELOW * len(spec.members)
        chunks = None
        if owners is not None:
            bounds = owner_bounds(spec, owners, world)
            chunks = [buffer[bounds[r]:bounds[r + 1]] for r in range(world)]
        packs.append(Pack(spec, buffer, buffer[: spec.numel], views, buffer[spec.numel :],
                          [params[i] for i in spec.members], [names[i] for i in spec.members], batched, wire, [],
                          codec=codec, chunks=chunks))
    return packs


def adopt_current_grads(packs: Sequence[Pack]) -> None:
    """Move the members' current gradients into ``packs`` (after a re-plan)."""
    for pack in packs:
        if pack.direct:  # the gradient stays where it is
            grad = pack.params[0].grad
            if grad is not None and grad.is_contiguous() and not grad.is_sparse:
                _direct_data(pack, grad)
            continue
        for p, view in zip(pack.params, pack.views):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = view


def gather(pack: Pack, scale: Optional[float], sparse_as_dense: bool) -> None:
    """Move the members' gradients into the pack's buffer, scaled; zeros where a member has none.

    Raises:
        RuntimeError: a sparse gradient without ``sparse_as_dense``, ``backward(create_graph=True)``,
            or a model converted (dtype, device) after the wrapper was built.
    """
    try:
        _gather(pack, scale, sparse_as_dense)
    except RuntimeError as exc:
        problem = _diagnose(pack)
        if problem is None:
            raise
        raise RuntimeError(problem) from exc


def gather_early(pack: Pack, j: int, scale: Optional[float], sparse_as_dense: bool) -> None:
    """Move member ``j``'s gradient in as soon as it is ready, so autograd's copy is freed at once.

    For packs of larger members only (``not pack.batched``): tiny ones are moved in
    together, with one fused copy, when the pack launches.
    """
    try:
        if _adopt_grad(pack.params[j], pack.names[j], pack.views[j], scale, sparse_as_dense):
            pack.moved.add(j)
    except RuntimeError as exc:
        problem = _diagnose(pack)
        if problem is None:
            raise
        raise RuntimeError(problem) from exc


def gather_nothing(pack: Pack) -> None:
    """Zeros for every member: what a rank that has joined sends."""
    pack.buffer.zero_()
    if pack.direct:
        _direct_data(pack, torch.zeros_like(pack.params[0], memory_format=torch.contiguous_format))
    pack.absent[:] = range(len(pack.params))


def probe_copy(pack: Pack) -> Pack:
    """``pack`` with zeroed buffers of its own, for a round that must leave the pack's as they are (a probe
    round, :meth:`distopt.engine.GradientEngine.probe`, while ``.grad`` are views of the pack's buffer). It
    shares the rest: the codec, the row-sparse state and the room for gathered copies, which such a round
    uses as any round does. A reduce-scatter's chunks (``shard_state="gradients"``) are cut from the new
    buffer where they lay in the old one, and its room for the others' chunks is its own: the owners' chunks
    of the pack stay as they are."""
    buffer = torch.zeros_like(pack.buffer)
    values = 0 if pack.direct else pack.spec.numel  # a direct pack's buffer is its flags
    chunks = None
    if pack.chunks is not None:
        base = pack.buffer.storage_offset()
        chunks = [buffer[c.storage_offset() - base:c.storage_offset() - base + c.numel()] for c in pack.chunks]
    return replace(pack, buffer=buffer, data=buffer[:values], views=[], flags=buffer[values:],
                   wire=None if pack.wire is None else torch.empty_like(pack.wire), absent=[], moved=set(),
                   chunks=chunks, scattered=None)


def scratch(pack: Pack) -> None:
    """Give a direct pack a fresh buffer, for values other than its gradient (an exchange)."""
    if pack.direct:
        _direct_data(pack, torch.empty_like(pack.params[0], memory_format=torch.contiguous_format))


def send_in_place(pack: Pack, tensor: Tensor) -> None:
    """A direct pack's exchange sends ``tensor`` (shaped like its parameter, contiguous) in place of the
    scratch buffer :func:`scratch` gave it: local SGD writes the pseudo-gradient over the parameter itself
    where the parameter takes the sync's values afterwards, so the sync holds no second copy of it."""
    _direct_data(pack, tensor)


def release(pack: Pack) -> None:
    """Let go of what a direct pack sent last (the round is over; ``.grad`` keeps it if it is the gradient)."""
    pack.data = pack.buffer[:0]
    pack.views = []


def _direct_data(pack: Pack, tensor: Tensor) -> None:
    """``tensor`` (shaped like the parameter, contiguous) is what the direct pack sends this round."""
    pack.data = tensor.view(-1)
    pack.views = [tensor]


def _gather_direct(pack: Pack, scale: Optional[float], sparse_as_dense: bool) -> None:
    param = pack.params[0]
    grad = param.grad
    if grad is not None and grad.is_sparse:
        if not sparse_as_dense:
            raise RuntimeError(_sparse_refused(pack.names[0]))
        grad = param.grad = grad.to_dense()
    if grad is None:
        gather_nothing(pack)
        pack.absent[:] = [0]
        return
    if grad.requires_grad:
        raise RuntimeError(_CREATE_GRAPH)
    if (grad.device, grad.dtype) != pack.spec.key or grad.shape != param.shape:
        raise RuntimeError(  # _diagnose explains a converted model instead, where that is the cause
            f"the gradient of {pack.names[0]!r} is {grad.dtype} {tuple(grad.shape)} on {grad.device}, but the "
            f"parameter is {param.dtype} {tuple(param.shape)} on {param.device}; give every parameter a gradient "
            "of its own dtype, shape and device"
        )
    if not grad.is_contiguous():  # a gradient set by hand; autograd keeps the parameter's layout
        grad = param.grad = grad.contiguous()
    if scale is not None:
        grad.mul_(scale)
    _direct_data(pack, grad)


def _gather(pack: Pack, scale: Optional[float], sparse_as_dense: bool) -> None:
    if pack.direct:
        _gather_direct(pack, scale, sparse_as_dense)
        return
    grads = [p.grad for p in pack.params]
    if pack.batched and all(g is not None and g is not v and not g.is_sparse for g, v in zip(grads, pack.views)):
        # Many small gradients: one fused copy and one scale beat a copy per tensor (and cat: 3x slower
        # at 100 tensors of 4 KiB).
        torch._foreach_copy_(pack.views, grads)
        if scale is not None:
            pack.data.mul_(scale)
        for p, view in zip(pack.params, pack.views):
            p.grad = view
        return
    for j, (param, view) in enumerate(zip(pack.params, pack.views)):
        if j in pack.moved:
            continue
        if not _adopt_grad(param, pack.names[j], view, scale, sparse_as_dense):
            view.zero_()
            pack.absent.append(j)


def _adopt_grad(param: Tensor, name: str, view: Tensor, scale: Optional[float], sparse_as_dense: bool) -> bool:
    """Make ``param.grad`` the buffer view ``view``; False if it has none."""
    grad = param.grad
    if grad is None:
        return False
    if grad.requires_grad:
        raise RuntimeError(_CREATE_GRAPH)
    if grad is view:  # accumulated in place
        if scale is not None:
            view.mul_(scale)
        return True
    if grad.is_sparse:
        if not sparse_as_dense:
            raise RuntimeError(_sparse_refused(name))
        grad = grad.to_dense()
    if scale is None:
        view.copy_(grad)
    else:
        torch.mul(grad, scale, out=view)
    param.grad = view
    return True


def _sparse_refused(name: str) -> str:
    return (
        f"parameter {name!r} has a sparse gradient, which distopt does not reduce; "
        "use dense gradients (e.g. nn.Embedding(..., sparse=False)) or pass sparse_as_dense=True"
    )


def _diagnose(pack: Pack) -> Optional[str]:
    """Why moving ``pack``'s gradients failed, if the model or the backward call changed under us."""
    for p, name in zip(pack.params, pack.names):
        if p.grad is not None and p.grad.requires_grad:
            return _CREATE_GRAPH
        if (p.device, p.dtype) != pack.spec.key:
            return (
                f"parameter {name!r} is now {p.dtype} on {p.device}, but it was {pack.spec.key[1]} on "
                f"{pack.spec.key[0]} when the DistributedOptimizer was built (model.to(), .half() or "
                ".double() after wrapping); convert the model first, then build the optimizer and the wrapper"
            )
    return None
