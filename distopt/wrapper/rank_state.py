"""``RankState``: this rank's own training state, as one entry of a ``torch.distributed.checkpoint``.

torch's distributed checkpoint (DCP) keeps one copy of each tensor of a state dict: a plain tensor is
taken as the same on every rank (it is written by one), and a DTensor as the shards of one global value.
That is what synchronous training holds. Between two syncs of local SGD or DiLoCo it is not: each
replica (a rank, or with :class:`distopt.Islands` an island) holds parameters and inner-optimizer state
of its own, and ``get_optimizer_state_dict`` keeps the inner optimizer's state only, not the last-sync
copies or the outer optimizer's state. :class:`RankState` is the ``Stateful`` that carries the rest:
under a key of this rank's own it holds this rank's parameters (its local shards with FSDP2) and
everything ``opt.state_dict()`` holds (the inner optimizer's state, the mode's: the last-sync copies,
the outer optimizer, the steps since the last sync, streaming's syncs in flight, compressor residuals),
so that a resume between two syncs is the uninterrupted run, bit for bit, at the same world size and
islands. See docs/islands.md ("Checkpoints").
"""
from __future__ import annotations

import io
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RankState"]


class RankState:
    """A ``torch.distributed.checkpoint`` ``Stateful`` for one wrapper's state on this rank.

    Pass it as one entry of the state dict given to ``dcp.save``; to resume, build the model and the
    wrapper as before, load the model's and the optimizer's entries and set them as usual, then load
    this entry last (a second ``dcp.load`` of it alone): it puts back this rank's own parameters and the
    wrapper's whole state, which the shared entries cannot hold between two syncs.

    Args:
        optimizer: the :class:`distopt.DistributedOptimizer` (any mode).

    Raises:
        TypeError: ``optimizer`` has no ``state_dict``/``load_state_dict``/``param_groups``.

    Example::

        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
        ...           "distopt": distopt.RankState(opt)}, checkpoint_id=path)
        >>> # to resume: the model and wrapper built alike, "model" and "optim" loaded and set, then
        >>> dcp.load({"distopt": distopt.RankState(opt)}, checkpoint_id=path)
    """

    def __init__(self, optimizer: Any) -> None:
        if not all(hasattr(optimizer, name) for name in ("state_dict", "load_state_dict", "param_groups")):
            raise TypeError(f"RankState takes a distopt.DistributedOptimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer

    @property
    def key(self) -> str:
        """This rank's key in the checkpoint (its global rank: each rank writes and reads its own)."""
        return f"rank{dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"

    def _params(self) -> List[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> Dict[str, Any]:
        """This rank's parameters and the wrapper's state dict, serialized under :attr:`key` (every rank
        must call it: the wrapper's ``state_dict()`` may communicate)."""
        state = {"params": [p.detach() for p in self._params()], "optimizer": self.optimizer.state_dict()}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return {self.key: buffer.getvalue()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Put back this rank's parameters and the wrapper's state (every rank, at the same point).

        Raises:
            ValueError: the checkpoint has no entry for this rank (saved at another world size), or holds
                another number of parameters.
        """
        blob = state_dict.get(self.key)
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError(
                f"the checkpoint holds no RankState entry for {self.key} (it has {sorted(state_dict)}): RankState "
                "resumes each rank from its own state, at the world size and islands it was saved with")
        saved = torch.load(io.BytesIO(blob), weights_only=False)
        params = self._params()
        if len(saved["params"]) != len(params):
            raise ValueError(
                f"the checkpoint's RankState holds {len(saved['params'])} parameters and this optimizer has "
                f"{len(params)}; load it into a model and DistributedOptimizer built as the saved ones were")
        with torch.no_grad():
            for p, value in zip(params, saved["params"]):
                p.copy_(value)
        self.optimizer.load_state_dict(saved["optimizer"])
