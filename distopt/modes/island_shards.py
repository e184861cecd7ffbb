"""FSDP2 inside an island: the DTensor parameters whose local shards :class:`distopt.Islands` syncs across.

The user shards the model over the island's ranks with FSDP2 (``fully_shard(model, mesh=mesh["shard"])``):
every parameter is then a DTensor over a 1-D mesh of this rank's island, FSDP2 all-gathers it for forward
and reduce-scatters (averages) its gradient inside the island during backward. Rank ``j`` of every island
holds the same shard ``j``, so syncing the islands is syncing each rank's local shard over its across
group: HSDP's replicate dimension, on which any across mode runs.

The across mode sees the local shards only, through one *alias* per parameter: a plain leaf tensor that
shares the local shard's storage (``p.to_local()``), so that what the across mode writes (local SGD's
averaged parameters) is the DTensor's, and whose identity stays fixed (local SGD keys its last-sync
copies by it). FSDP2 may move a local shard (a load with ``assign=True``): :meth:`LocalShards.refresh`
points the aliases at the current storage before each use.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..planning import drift

__all__ = ["LocalShards", "mesh_ranks_of", "mesh_disagreement", "is_dtensor"]


def _dtensor_class() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensor
        return None
    return DTensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor."""
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def mesh_ranks_of(optimizer: Optimizer, names: Dict[int, str]) -> Optional[List[Tuple[int, ...]]]:
    """The ranks of the meshes the optimizer's DTensor parameters are sharded over, or None where none is one.

    Args:
        optimizer: the inner optimizer.
        names: the parameters' names by ``id`` (where the user gave them), for errors.

    Returns:
        The distinct meshes' global ranks, sorted; None: no parameter is a DTensor (plain replicas inside).

    Raises:
        ValueError: some parameters are DTensors and others are not, a DTensor is over a mesh of more than
            one dimension (HSDP: FSDP2 would then all-reduce across the islands itself), or not sharded
            (a ``Replicate`` placement: nothing would average its gradient inside the island).
    """
    cls = _dtensor_class()
    if cls is None:
        return None
    plain: Optional[str] = None
    meshes = set()
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            name = names.get(id(p), f"param_groups[{g}][{j}]")
            if not isinstance(p, cls):
                plain = plain or name
                continue
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise ValueError(
                    f"parameter {name!r} is a DTensor over a {mesh.ndim}-D mesh (placements {tuple(p.placements)}): "
                    "FSDP2 over the whole 2-D mesh (HSDP) all-reduces the gradients across the islands itself, every "
                    "step. With distopt.Islands, shard over the island's dimension only, fully_shard(model, "
                    "mesh=mesh['shard']), and pass islands=mesh: the mode across then runs on the replicate dimension")
            if not all(placement.is_shard() for placement in p.placements):
                raise ValueError(
                    f"parameter {name!r} is a DTensor with placements {tuple(p.placements)}: distopt.Islands takes "
                    "FSDP2's sharded parameters (a Shard placement over the island), whose gradients FSDP2 averages "
                    "inside the island; shard the model with fully_shard(model, mesh=mesh['shard'])")
            meshes.add(tuple(int(r) for r in mesh.mesh.flatten().tolist()))
    if not meshes:
        return None
    if plain is not None:
        raise ValueError(
            f"parameter {plain!r} is a plain tensor, but other parameters are DTensors (FSDP2): with FSDP2 inside the "
            "islands, every parameter the optimizer holds must be sharded; apply fully_shard to the root module too")
    return sorted(meshes)


def mesh_disagreement(meshes: Sequence[Optional[List[Tuple[int, ...]]]], ranks: Sequence[int],
                      islands: Sequence[Tuple[int, ...]]) -> Optional[str]:
    """Whether every rank's FSDP2 mesh is its island, and every rank shards alike; None where they do.

    Args:
        meshes: for each rank of ``ranks``, :func:`mesh_ranks_of`'s answer.
        ranks: the global ranks of the group, in the order of ``meshes``.
        islands: the agreed islands (global ranks).

    Returns:
        The error message (the same on every rank, which all hold every rank's meshes), or None.
    """
    sharded = [rank for rank, m in zip(ranks, meshes) if m is not None]
    if not sharded:
        return None
    plain = [rank for rank, m in zip(ranks, meshes) if m is None]
    if plain:
        return (f"rank(s) {sharded} hold DTensor parameters (FSDP2) and rank(s) {plain} plain ones; apply the same "
                "fully_shard on every rank")
    for rank, mine in zip(ranks, meshes):
        island = next(i for i in islands if rank in i)
        if mine != [tuple(island)]:
            return (f"rank {rank}'s parameters are sharded over the ranks {[list(m) for m in mine]}, but its island is "
                    f"{list(island)}: FSDP2 must shard over the island's ranks, the same dimension of the mesh given "
                    "as islands=; build init_device_mesh(device, (islands, k), mesh_dim_names=('replicate', 'shard')), "
                    "apply fully_shard(model, mesh=mesh['shard']) and pass islands=mesh")
    return None


class LocalShards:
    """One alias per DTensor parameter: a leaf tensor over its local shard's storage.

    Args:
        params: the DTensor parameters, in the wrapper's tracking order.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        with torch.no_grad():
            self.aliases: List[Tensor] = [p.to_local().detach().requires_grad_(p.requires_grad) for p in self.params]

    def refresh(self) -> List[Tensor]:
        """Point every alias at its parameter's local shard as it is now (FSDP2 may have moved it), keeping
        the alias's identity. Returns the aliases."""
        with torch.no_grad():
            for p, alias in zip(self.params, self.aliases):
                local = p.to_local()
                if alias.data_ptr() != local.data_ptr() or alias.shape != local.shape:
                    alias.data = local.detach()
                alias.requires_grad_(p.requires_grad)
        return self.aliases

    def kept_identical(self, optimizer: Optimizer, steps: int) -> drift.Kept:
        """What synchronous training across keeps alike on the ranks that hold the same shards (an across
        group): the local shards of the parameters and of their optimizer state, the hyperparameters and
        the step count."""
        state = drift.state_items(optimizer, self.params, "optimizer state")
        return drift.Kept(
            per_param=[[(drift.PARAMETER, alias)] + [(name, _local(value)) for name, value in items]
                       for alias, items in zip(self.refresh(), state)],
            shared=drift.hyperparameter_items(optimizer) + [("the step count", steps)],
            what="the parameters' local shards, their optimizer state, its hyperparameters and the step count",
        )

    def local_grad(self, i: int) -> Optional[Tensor]:
        """Parameter ``i``'s gradient's local shard (FSDP2's island mean), or None."""
        grad = self.params[i].grad
        if grad is None:
            return None
        return grad.to_local() if is_dtensor(grad) else grad

    def set_grad(self, i: int, local: Tensor) -> None:
        """Give parameter ``i`` the gradient whose local shard is ``local`` (it had none on this island)."""
        from torch.distributed.tensor import DTensor
        p = self.params[i]
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride())


def _local(value: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    return value.to_local() if is_dtensor(value) else value
