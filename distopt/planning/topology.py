"""Islands: a group of ranks cut into equal parts that talk fast inside and slowly between them.

A *topology* is a list of *islands*, each a tuple of global ranks (those ``dist.new_group``
takes): typically the ranks of one host. Every island has the same number of ranks, ``k``; the
ranks at the same place ``j`` of every island form an *across group*, which carries what travels
between the islands. Ranks are sorted inside each island and the islands by their first rank, so
that a rank's place in its island is its rank in the island's process group (torch sorts a new
group's ranks) and every rank builds the same groups in the same order.

Three sources give a topology, each pure here (the process groups are built by
:mod:`distopt.modes.islands`):

- explicit groups, a list of rank lists (:func:`from_groups`);
- the ranks of a ``DeviceMesh`` of two dimensions, one of them the replicate dimension
  (:func:`from_mesh`);
- where each rank runs, as torchrun and :func:`distopt.launch` say it (:func:`from_hosts`): one
  island per host.

Every function raises ``ValueError`` naming the argument, the bad value and the fix; the ranks
compare their topologies before any group is built (:func:`disagreement`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Topology", "from_groups", "from_mesh", "from_hosts", "disagreement"]


@dataclass(frozen=True)
class Topology:
    """Islands of equal size that cover a group.

    Attributes:
        islands: each island's global ranks, ascending; the islands ordered by their first rank.
    """

    islands: Tuple[Tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """Ranks per island (``k``)."""
        return len(self.islands[0])

    @property
    def count(self) -> int:
        """Islands."""
        return len(self.islands)

    def island_of(self, rank: int) -> int:
        """The index of the island that holds global ``rank``.

        Raises:
            ValueError: no island holds it.
        """
        for i, island in enumerate(self.islands):
            if rank in island:
                return i
        raise ValueError(f"rank {rank} is in no island of {self.describe()}")

    def place_of(self, rank: int) -> int:
        """Global ``rank``'s place in its island (its rank in the island's process group)."""
        return self.islands[self.island_of(rank)].index(rank)

    def across(self) -> List[Tuple[int, ...]]:
        """The across groups: for each place ``j``, the ranks at place ``j`` of every island."""
        return [tuple(island[j] for island in self.islands) for j in range(self.size)]

    def describe(self) -> str:
        """The islands as a user writes them: ``[[0, 1], [2, 3]]``."""
        return str([list(island) for island in self.islands])


def from_groups(groups: Any, ranks: Sequence[int], argument: str = "islands") -> Topology:
    """The topology of explicit groups of global ranks, checked against the ranks they must cover.

    Args:
        groups: a list of rank lists, e.g. ``[[0, 1], [2, 3]]``.
        ranks: the global ranks of the group the islands divide (the wrapper's ``process_group``).
        argument: the argument's name, for errors.

    Returns:
        The topology, each island sorted and the islands ordered by their first rank.

    Raises:
        TypeError: ``groups`` is not a list of lists of ints.
        ValueError: an island is empty, the islands overlap, differ in size, or do not cover ``ranks``
            exactly.
    """
    example = "[[0, 1], [2, 3]]"
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)) or not groups:
        raise TypeError(
            f"{argument} must be a non-empty list of rank lists, e.g. {argument}={example} (one list per island "
            f"of global ranks), got {groups!r}")
    islands: List[Tuple[int, ...]] = []
    for group in groups:
        if isinstance(group, (str, bytes)) or not isinstance(group, (list, tuple)) or not group:
            raise TypeError(f"{argument} must be a list of non-empty rank lists, e.g. {argument}={example}; "
                            f"got the island {group!r} in {argument}={groups!r}")
        for rank in group:
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise TypeError(f"{argument} must hold global ranks (ints), got {rank!r} in {argument}={groups!r}")
        islands.append(tuple(sorted(group)))
    seen: Dict[int, int] = {}
    for i, island in enumerate(islands):
        if len(set(island)) != len(island):
            raise ValueError(f"{argument}={_shown(groups)}: the island {list(groups[i])} names a rank twice; "
                             "name each rank once")
        for rank in island:
            if rank in seen:
                raise ValueError(
                    f"{argument}={_shown(groups)}: rank {rank} is in two islands ({list(groups[seen[rank]])} and "
                    f"{list(groups[i])}); the islands must not overlap: put each rank in one island")
            seen[rank] = i
    sizes = sorted({len(island) for island in islands})
    if len(sizes) > 1:
        raise ValueError(
            f"{argument}={_shown(groups)}: the islands differ in size ({', '.join(map(str, sizes))} ranks); every "
            "island must have the same number of ranks (the same number of processes on every host)")
    expected = sorted(ranks)
    if sorted(seen) != expected:
        missing = sorted(set(expected) - set(seen))
        extra = sorted(set(seen) - set(expected))
        parts = ([f"leave out rank(s) {missing}"] if missing else []) + (
            [f"name rank(s) {extra}, which are not in the group"] if extra else [])
        raise ValueError(
            f"{argument}={_shown(groups)} must cover the group's ranks {expected} exactly, each once, but they "
            f"{' and '.join(parts)}; list every rank of the group in one island")
    return Topology(tuple(sorted(islands)))


def from_mesh(mesh_ranks: Any, dim_names: Optional[Sequence[str]], ranks: Sequence[int],
              argument: str = "islands") -> Topology:
    """The topology of a two-dimensional ``DeviceMesh``: the islands are its rows along the replicate dimension.

    The replicate dimension is the one named ``"replicate"``, else the first (HSDP's convention:
    ``init_device_mesh(device, (islands, k), mesh_dim_names=("replicate", "shard"))``). Each island is
    the ranks that share one index along it: the ranks FSDP2 shards over, or the plain replicas of
    one host.

    Args:
        mesh_ranks: ``mesh.mesh.tolist()``, the global ranks by mesh coordinate.
        dim_names: ``mesh.mesh_dim_names`` (None: unnamed).
        ranks: the global ranks of the group the islands divide.
        argument: the argument's name, for errors.

    Raises:
        ValueError: the mesh is not two-dimensional, or its ranks do not cover ``ranks`` exactly.
    """
    if not isinstance(mesh_ranks, list) or not mesh_ranks or not all(
            isinstance(row, list) and row and all(isinstance(r, int) for r in row) for row in mesh_ranks):
        raise ValueError(
            f"{argument}= got a DeviceMesh of shape other than two dimensions (ranks {mesh_ranks!r}); pass a 2-D "
            f"mesh, e.g. init_device_mesh('cpu', (hosts, k), mesh_dim_names=('replicate', 'shard')), or the "
            f"islands as rank lists")
    names = list(dim_names) if dim_names is not None else []
    rows = mesh_ranks
    if len(names) == 2 and names[1] == "replicate" and names[0] != "replicate":
        rows = [list(column) for column in zip(*mesh_ranks)]
    return from_groups(rows, ranks, argument)


def from_hosts(places: Sequence[Optional[Tuple[Any, int]]], ranks: Sequence[int],
               argument: str = "islands") -> Topology:
    """One island per host, from where every rank says it runs.

    Args:
        places: for each rank of ``ranks`` (in that order), ``(host, local_rank)`` as the launcher
            set it up (:func:`distopt.launching.placement.this_process`), or None where it did not.
        ranks: the global ranks of the group.
        argument: the argument's name, for errors.

    Raises:
        ValueError: a rank does not know its host (no launcher set it up), or the hosts run different
            numbers of ranks.
    """
    unknown = [rank for rank, place in zip(ranks, places) if place is None]
    if unknown:
        raise ValueError(
            f"{argument}=None takes one island per host from LOCAL_RANK, LOCAL_WORLD_SIZE and RANK (GROUP_RANK under "
            f"torchrun), which rank(s) {unknown} lack: start the job with torchrun or distopt.launch, or pass the "
            f"islands as rank lists, e.g. {argument}=[[0, 1], [2, 3]]")
    hosts: Dict[Any, List[int]] = {}
    for rank, place in zip(ranks, places):
        hosts.setdefault(place[0], []).append(rank)
    groups = list(hosts.values())
    sizes = sorted({len(group) for group in groups})
    if len(sizes) > 1:
        raise ValueError(
            f"{argument}=None takes one island per host, but the hosts run different numbers of ranks "
            f"({_shown(groups)}); start the same number of processes on every host (--nproc-per-node), or pass "
            f"the islands as rank lists of equal size")
    return from_groups(groups, ranks, argument)


def disagreement(views: Sequence[Any], argument: str = "islands") -> Optional[str]:
    """What differs between the ranks' topologies, or None where every rank agrees.

    Args:
        views: every rank's view, by rank in the group: a :class:`Topology`, or the message of the
            error its own arguments raised.
        argument: the argument's name, for the message.

    Returns:
        A message naming the argument, two ranks and their views, and the fix: the first error a rank
        raised, as every rank must raise the same; else the first two ranks that differ.
    """
    for rank, view in enumerate(views):
        if isinstance(view, str):
            return f"rank {rank}: {view}" if len(views) > 1 else view
    first = views[0]
    for rank, view in enumerate(views):
        if view != first:
            return (f"the ranks disagree on the islands: rank 0 has {argument}={first.describe()} and rank {rank} "
                    f"has {argument}={view.describe()}; pass the same {argument}= on every rank (every rank must "
                    "build the same islands)")
    return None


def _shown(groups: Any) -> str:
    return str([list(group) for group in groups])
