"""The updated parameters on their way from their owners to the other ranks, after a sharded step.

With ``shard_state=True`` each rank steps the parameters it owns, and sends them
to the others. By default (``ShardedState(share="in_step")``) the share is
launched at the end of the step and waited for before ``step()`` returns. With
``ShardedState(share="background")`` the others need them before they next use
them, not when ``step()`` returns, so the share is finished lazily:

* **Launch.** Every parameter travels point to point, all posted at once, in one
  fixed order that every rank derives from the plan: the packs in reverse launch
  order, which is about the order of the next forward pass. A parameter of
  :data:`SMALL_BYTES` or more goes straight from its owner's tensor into each other
  rank's (no buffer, no copy; a GPU parameter over gloo, which sends host memory
  only, through a host copy); smaller ones travel together, since each transfer
  has a fixed cost. At two ranks both directions of the link carry parameters at
  the same time.
* **Finish per module** (``share="background"`` only). While a share is in flight, a global module forward
  pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) waits,
  before each module's forward, for the parameters that module holds (its own,
  and those of children without a ``forward`` of their own, such as a
  ``ParameterList``), so the next forward overlaps the rest of the share. The
  hook is removed once every parameter has arrived. Modules that ran while a
  share was in flight also get a ``state_dict`` pre-hook that finishes it, so
  ``model.state_dict()`` right after ``step()`` never saves parameters in flight.
* **Finish all** (:meth:`ParameterShare.finish`): at the end of ``step()`` by default; in the
  background variant at the next ``step()``,
  ``opt.synchronize()``, the drift check, the state dicts, a parameter broadcast,
  the end of a join block and ``close()``; the mode calls it.
* **Never silently stale.** A parameter changed in place between ``step()`` and
  its arrival (clamped, re-initialised) would be overwritten on some ranks and
  not on others: the version counter of every parameter is recorded at launch,
  and a change raises a ``RuntimeError`` that names ``opt.synchronize()``.
  Reading a parameter outside a module's forward (an EMA, a checkpoint that
  does not go through ``state_dict()``) between ``step()`` and the next forward
  needs ``opt.synchronize()`` first; the data keeps arriving in the background
  meanwhile, so a program that never calls it still ends with every rank
  holding every parameter once the transfers are done.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from ..transport import stalls, waiting

__all__ = ["SMALL_BYTES", "BATCH_BYTES", "Transfer", "ParameterShare", "launch_share", "held_by"]

# A module's ``forward`` when its class defines none (containers such as ParameterList, ModuleList).
_NO_FORWARD = nn.Module.forward


#: A parameter of fewer bytes travels with others of its owner, dtype and device, in one transfer of at most
#: :data:`BATCH_BYTES`: a point-to-point transfer costs about 0.1 ms on loopback whatever its size, and a model
#: has many small parameters (biases, norms). The copy this needs holds the small parameters alone.
SMALL_BYTES = 64 << 10
BATCH_BYTES = 1 << 20


class Transfer:
    """One received transfer: the parameters it carries and where they arrive.

    Args:
        params: the parameters, in the order they lie in the tensor received.
        work: the receive's work handle; ``number``: its number for the stall inspector.
        staging: the tensor received into when it is not the one parameter itself (several
            parameters, a non-contiguous one, a GPU one over gloo); None: received in place.
    """

    __slots__ = ("params", "work", "number", "staging")

    def __init__(self, params: List[Tensor], work: Any, number: int, staging: Optional[Tensor]) -> None:
        self.params, self.work, self.number, self.staging = params, work, number, staging


class ParameterShare:
    """One step's parameters in flight: the transfers, and what each rank still waits for.

    Args:
        receives: the transfers this rank receives.
        sends: ``(work, number)`` per transfer this rank sends (with the tensor it sends, kept alive).
        params: every shared parameter, whose version counters are recorded now.
        names: a name per parameter, by ``id``, for errors.
        progress: this rank's position for the stall inspector, or None.
        is_cuda: the transfers are of GPU tensors (NCCL): waited for without a timeout.
    """

    def __init__(self, receives: List[Transfer], sends: List[Tuple[Any, int, Tensor]], params: Sequence[Tensor],
                 names: Dict[int, str], progress: Optional[stalls.Progress], is_cuda: bool) -> None:
        self.pending: Dict[int, Transfer] = {id(p): t for t in receives for p in t.params}
        self.sends = sends
        self.versions: Dict[int, Tuple[Tensor, int]] = {id(p): (p, p._version) for p in params}
        self.names = names
        self.progress = progress
        self.is_cuda = is_cuda
        #: Bytes this rank sends.
        self.sent_bytes = sum(t.numel() * t.element_size() for _, _, t in sends)
        self._hook: Optional[Any] = None

    def watch_forward(self, on_module: Callable[[nn.Module], None]) -> None:
        """Wait in every module's forward pre-hook for that module's parameters (``on_module`` does)."""
        if self.pending:
            def pre_hook(module: nn.Module, args: Any) -> None:
                on_module(module)

            self._hook = torch_module.register_module_forward_pre_hook(pre_hook)

    def wait_for(self, params: Sequence[Tensor]) -> None:
        """Wait until those of ``params`` that this rank receives have arrived."""
        for p in params:
            transfer = self.pending.get(id(p))
            if transfer is not None:
                self._arrive(transfer)
        if not self.pending:
            self._unhook()

    def finish(self) -> None:
        """Wait for every transfer, received and sent, then check that no parameter changed meanwhile.

        Raises:
            RuntimeError: a parameter was changed in place while the share was in flight.
        """
        try:
            while self.pending:
                self._arrive(next(iter(self.pending.values())))
            sends, self.sends = self.sends, []
            for k, (work, seq, _) in enumerate(sends):
                waiting.wait_for(work, self.is_cuda, self.progress, seq,
                                 f"transfer {k + 1}/{len(sends)} of the parameter share (sending)", None)
        finally:
            self._unhook()
        changed = [self.names.get(key, "a parameter") for key, (p, version) in self.versions.items()
                   if p._version != version]
        self.versions = {}
        if changed:
            raise RuntimeError(
                f"parameters were changed in place after opt.step() while the updated parameters were still on "
                f"their way between the ranks (ShardedState(share='background') shares them until they are next "
                f"used): {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}. The ranks now hold "
                f"different values. Call opt.synchronize() right after opt.step() before changing or reading "
                f"parameters outside the model's forward"
            )

    def _arrive(self, transfer: Transfer) -> None:
        first = transfer.params[0]
        what = self.names.get(id(first), "a parameter")
        if len(transfer.params) > 1:
            what += f" and {len(transfer.params) - 1} more"
        waiting.wait_for(transfer.work, self.is_cuda, self.progress, transfer.number,
                         f"the parameter share (receiving {what})", None)
        for p in transfer.params:
            del self.pending[id(p)]
        if transfer.staging is not None:
            offset = 0
            with torch.no_grad():
                for p in transfer.params:
                    n = p.numel()
                    p.copy_(transfer.staging[offset:offset + n].view_as(p))
                    offset += n
                    # Our own copy, not the user's change: the check at finish() is about theirs.
                    key = id(p)
                    if key in self.versions and self.versions[key][1] == p._version - 1:
                        self.versions[key] = (p, p._version)

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def launch_share(params: Sequence[Tensor], owner_of: Dict[int, int], rank: int, active: Sequence[int], group: Any,
                 progress: Optional[stalls.Progress], names: Dict[int, str]) -> Optional[ParameterShare]:
    """Send the parameters this rank owns to the other ranks in ``active``, and receive theirs.

    A parameter of :data:`SMALL_BYTES` or more travels alone, straight from its owner's tensor
    into the others'; smaller ones travel together, per owner, dtype and device, in transfers
    of up to :data:`BATCH_BYTES`.

    Args:
        params: the parameters to share, in the order every rank uses (the same on every rank).
        owner_of: each parameter's owner, by ``id`` (a rank in ``active``).
        rank: this rank, in ``group``.
        active: the ranks still training (a rank that has joined takes no part).
        group: the process group.
        progress: this rank's position for the stall inspector, or None.
        names: a name per parameter, by ``id``, for errors.

    Returns:
        The share in flight, or None where this rank takes no part or there is nothing to send.
    """
    if rank not in active or len(active) < 2:
        return None
    peers = [r for r in active if r != rank]
    # Gloo sends and receives host memory only: a GPU parameter travels through a host copy there.
    host_only = dist.get_backend(group) == "gloo"
    # The transfers, in the order of their first parameter: a batch of small parameters goes where its first
    # member would have gone, so that the next forward finds it early enough.
    transfers: List[Tuple[int, List[Tensor]]] = []
    open_batches: Dict[Any, Tuple[List[Tensor], int]] = {}
    for p in params:
        nbytes = p.numel() * p.element_size()
        owner = owner_of[id(p)]
        if nbytes >= SMALL_BYTES:
            transfers.append((owner, [p]))
            continue
        key = (owner, p.dtype, p.device)
        batch = open_batches.get(key)
        if batch is None or batch[1] + nbytes > BATCH_BYTES:
            members: List[Tensor] = []
            transfers.append((owner, members))
            batch = (members, 0)
        batch[0].append(p)
        open_batches[key] = (batch[0], batch[1] + nbytes)
    receives: List[Transfer] = []
    sends: List[Tuple[Any, int, Tensor]] = []
    is_cuda = False
    # Point-to-point transfers are not counted as collectives of the group: a rank that has joined issues none.
    aside = progress.aside() if progress is not None else contextlib.nullcontext()
    with torch.no_grad(), aside:
        for tag, (owner, members) in enumerate(transfers):
            flat = members[0].detach()
            on_host = host_only and flat.device.type != "cpu"
            is_cuda = is_cuda or (flat.is_cuda and not on_host)
            alone = len(members) == 1 and flat.is_contiguous() and not on_host
            if owner == rank:
                if alone:
                    tensor = flat
                else:
                    tensor = torch.cat([m.detach().reshape(-1) for m in members])
                    tensor = tensor.cpu() if on_host else tensor
                for peer in peers:
                    work = group.send([tensor], peer, tag)
                    sends.append((work, progress.issue() if progress is not None else 0, tensor))
            else:
                staging = None
                if not alone:
                    staging = torch.empty(sum(m.numel() for m in members), dtype=flat.dtype,
                                          device="cpu" if on_host else flat.device)
                work = group.recv([flat if staging is None else staging], owner, tag)
                receives.append(Transfer(members, work, progress.issue() if progress is not None else 0, staging))
    if not receives and not sends:
        return None
    return ParameterShare(receives, sends, params, names, progress, is_cuda)


def held_by(module: nn.Module) -> List[Tensor]:
    """The parameters ``module``'s forward may read as its own: those it holds directly, and those of
    children without a ``forward`` of their own (``ParameterList``, ``ParameterDict``, containers).
    A model compiled with ``torch.compile`` holds all of its own: its modules' pre-hooks may not run
    inside the compiled code."""
    if type(module).__name__ == "OptimizedModule":
        return list(module.parameters())
    found = list(module.parameters(recurse=False))
    for child in module.children():
        if type(child).forward is _NO_FORWARD:
            found.extend(held_by(child))
    return found

