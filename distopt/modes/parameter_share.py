"""The updated parameters on their way from their owners to the other ranks, after a sharded step.

With ``shard_state=True`` each rank steps the parameters it owns; the others
need them before they next use them, not when ``step()`` returns. So the share
is launched at the end of the step and finished lazily:

* **Launch.** Every parameter travels point to point, straight from its owner's
  tensor into each other rank's (no staging buffer, no copy; a GPU parameter over
  gloo, which sends host memory only, through a host copy), all posted at once, in
  one fixed order that every rank derives from the plan: the packs in reverse
  launch order, which is about the order of the next forward pass. At two ranks
  both directions of the link carry parameters at the same time.
* **Finish per module.** While a share is in flight, a global module forward
  pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) waits,
  before each module's forward, for the parameters that module holds (its own,
  and those of children without a ``forward`` of their own, such as a
  ``ParameterList``), so the next forward overlaps the rest of the share. The
  hook is removed once every parameter has arrived. Modules that ran while a
  share was in flight also get a ``state_dict`` pre-hook that finishes it, so
  ``model.state_dict()`` right after ``step()`` never saves parameters in flight.
* **Finish all** (:meth:`ParameterShare.finish`): at the next ``step()``,
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

__all__ = ["ParameterShare", "launch_share", "held_by"]

# A module's ``forward`` when its class defines none (containers such as ParameterList, ModuleList).
_NO_FORWARD = nn.Module.forward


class ParameterShare:
    """One step's parameters in flight: the transfers, and what each rank still waits for.

    Args:
        receives: ``(param, work, number, staging)`` per parameter this rank receives
            (``staging``: a contiguous host or device tensor received into, copied into the
            parameter on arrival, for a non-contiguous parameter or a GPU one over gloo; else None).
        sends: ``(work, number)`` per transfer this rank sends.
        versions: each shared parameter and its version counter at launch.
        names: a name per parameter, by ``id``, for errors.
        progress: this rank's position for the stall inspector, or None.
        is_cuda: the transfers are of GPU tensors (NCCL): waited for without a timeout.
    """

    def __init__(self, receives: List[Tuple[Tensor, Any, int, Optional[Tensor]]], sends: List[Tuple[Any, int]],
                 versions: List[Tuple[Tensor, int]], names: Dict[int, str], progress: Optional[stalls.Progress],
                 is_cuda: bool) -> None:
        self.pending: Dict[int, Tuple[Tensor, Any, int, Optional[Tensor]]] = {id(r[0]): r for r in receives}
        self.sends = sends
        self.versions = versions
        self.names = names
        self.progress = progress
        self.is_cuda = is_cuda
        self.count = len(receives) + len(sends)
        #: Bytes this rank sends.
        self.sent_bytes = 0
        self._hook: Optional[Any] = None

    @property
    def done(self) -> bool:
        return not self.pending and not self.sends

    def watch_forward(self, on_module: Callable[[nn.Module], None]) -> None:
        """Wait in every module's forward pre-hook for that module's parameters (``on_module`` does)."""
        if self.pending:
            def pre_hook(module: nn.Module, args: Any) -> None:
                on_module(module)

            self._hook = torch_module.register_module_forward_pre_hook(pre_hook)

    def wait_for(self, params: Sequence[Tensor]) -> None:
        """Wait until those of ``params`` that this rank receives have arrived."""
        for p in params:
            entry = self.pending.get(id(p))
            if entry is not None:
                self._arrive(entry)
        if not self.pending:
            self._unhook()

    def finish(self) -> None:
        """Wait for every transfer, received and sent, then check that no parameter changed meanwhile.

        Raises:
            RuntimeError: a parameter was changed in place while the share was in flight.
        """
        try:
            for entry in list(self.pending.values()):
                self._arrive(entry)
            sends, self.sends = self.sends, []
            for k, (work, seq) in enumerate(sends):
                waiting.wait_for(work, self.is_cuda, self.progress, seq,
                                 f"transfer {k + 1}/{len(sends)} of the parameter share (sending)", None)
        finally:
            self._unhook()
        changed = [self.names.get(id(p), "a parameter") for p, version in self.versions if p._version != version]
        self.versions = []
        if changed:
            raise RuntimeError(
                f"parameters were changed in place after opt.step() while the updated parameters were still on "
                f"their way between the ranks (shard_state=True shares them in the background until they are "
                f"next used): {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}. The ranks now hold "
                f"different values. Call opt.synchronize() right after opt.step() before changing or reading "
                f"parameters outside the model's forward"
            )

    def _arrive(self, entry: Tuple[Tensor, Any, int, Optional[Tensor]]) -> None:
        p, work, seq, staging = entry
        waiting.wait_for(work, self.is_cuda, self.progress, seq,
                         f"the parameter share (receiving {self.names.get(id(p), 'a parameter')})", None)
        del self.pending[id(p)]
        if staging is not None:
            version = p._version
            with torch.no_grad():
                p.copy_(staging.view_as(p))
            # Our own copy, not the user's change: keep the check at finish() about theirs.
            self.versions = [(q, v + (p._version - version) if q is p else v) for q, v in self.versions]

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def launch_share(params: Sequence[Tensor], owner_of: Dict[int, int], rank: int, active: Sequence[int], group: Any,
                 progress: Optional[stalls.Progress], names: Dict[int, str]) -> Optional[ParameterShare]:
    """Send the parameters this rank owns to the other ranks in ``active``, and receive theirs.

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
    receives: List[Tuple[Tensor, Any, int, Optional[Tensor]]] = []
    sends: List[Tuple[Any, int]] = []
    is_cuda = False
    # Gloo sends and receives host memory only: a GPU parameter travels through a host copy there.
    host_only = dist.get_backend(group) == "gloo"
    # Point-to-point transfers are not counted as collectives of the group: a rank that has joined issues none.
    aside = progress.aside() if progress is not None else contextlib.nullcontext()
    with torch.no_grad(), aside:
        for tag, p in enumerate(params):
            owner = owner_of[id(p)]
            flat = p.detach()
            on_host = host_only and flat.device.type != "cpu"
            is_cuda = is_cuda or (flat.is_cuda and not on_host)
            staging = None
            if on_host:
                staging = torch.empty(flat.shape, dtype=flat.dtype, device="cpu")
            elif not flat.is_contiguous():
                staging = torch.empty_like(flat, memory_format=torch.contiguous_format)
            if owner == rank:
                tensor = flat if staging is None else staging.copy_(flat)
                for peer in peers:
                    work = group.send([tensor], peer, tag)
                    sends.append((work, progress.issue() if progress is not None else 0))
            else:
                work = group.recv([flat if staging is None else staging], owner, tag)
                receives.append((p, work, progress.issue() if progress is not None else 0, staging))
    if not receives and not sends:
        return None
    versions = [(p, p._version) for p in params]
    share = ParameterShare(receives, sends, versions, names, progress, is_cuda)
    share.sent_bytes = sum(p.numel() * p.element_size() for p in params if owner_of[id(p)] == rank) * len(peers)
    return share


def held_by(module: nn.Module) -> List[Tensor]:
    """The parameters ``module``'s forward may read as its own: those it holds directly, and those of
    children without a ``forward`` of their own (``ParameterList``, ``ParameterDict``, containers)."""
    found = list(module.parameters(recurse=False))
    for child in module.children():
        if type(child).forward is _NO_FORWARD:
            found.extend(held_by(child))
    return found

