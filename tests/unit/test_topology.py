"""The islands' topology, pure: from explicit groups, a DeviceMesh's ranks and the hosts, and the ranks'
agreement (:mod:`distopt.planning.topology`), property-tested without processes."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.planning import topology
from distopt.planning.topology import Topology


@st.composite
def partitions(draw):
    """A shuffled partition of a group's ranks into equal islands, with the ranks it covers."""
    count = draw(st.integers(1, 5))
    size = draw(st.integers(1, 5))
    base = draw(st.integers(0, 3))  # a subgroup of the world need not start at 0
    ranks = list(range(base, base + count * size))
    shuffled = draw(st.permutations(ranks))
    groups = [list(shuffled[i * size:(i + 1) * size]) for i in range(count)]
    return groups, ranks


@settings(max_examples=200, deadline=None)
@given(partitions())
def test_equal_disjoint_islands_that_cover_the_group_are_normalized_and_give_the_across_groups(case):
    groups, ranks = case
    top = topology.from_groups(groups, ranks)
    assert sorted(r for island in top.islands for r in island) == ranks
    assert all(list(island) == sorted(island) for island in top.islands)
    assert [island[0] for island in top.islands] == sorted(island[0] for island in top.islands)
    assert top.count == len(groups) and top.size == len(groups[0])
    # The same islands in any order, each in any order, are the same topology.
    again = [random.Random(0).sample(g, len(g)) for g in reversed(groups)]
    assert topology.from_groups(again, ranks) == top
    # Rank j of every island forms across group j; each rank is in exactly one, at its place.
    across = top.across()
    assert sorted(r for group in across for r in group) == ranks
    for rank in ranks:
        place = top.place_of(rank)
        assert rank in across[place] and top.islands[top.island_of(rank)][place] == rank


@settings(max_examples=100, deadline=None)
@given(partitions(), st.data())
def test_islands_that_overlap_differ_in_size_or_miss_a_rank_are_refused_naming_the_argument(case, data):
    groups, ranks = case
    broken = [list(g) for g in groups]
    how = data.draw(st.sampled_from(["overlap", "size", "missing", "extra"]))
    if how == "overlap" and len(broken) > 1:
        broken[1][0] = broken[0][0]
        match = r"islands=.*: rank \d+ is in two islands .* must not overlap"
    elif how == "size" and len(broken) > 1 and len(broken[0]) > 1:
        broken[0].pop()
        broken[1].append(max(ranks) + 1)
        match = r"the islands differ in size \([\d, ]+ ranks\); every island must have the same number"
    elif how == "extra":
        broken.append([max(ranks) + 1 + i for i in range(len(broken[0]))])
        match = r"must cover the group's ranks .* name rank\(s\) \[.*\], which are not in the group"
    else:
        ranks = ranks + [max(ranks) + 1]
        match = r"must cover the group's ranks .* leave out rank\(s\) \[\d+\]"
    with pytest.raises(ValueError, match=match):
        topology.from_groups(broken, ranks)


@pytest.mark.parametrize("groups, error, match", [
    ("0,1", TypeError, r"islands must be a non-empty list of rank lists, e.g. islands=\[\[0, 1\], \[2, 3\]\]"),
    ([], TypeError, r"non-empty list of rank lists"),
    ([[0, 1], []], TypeError, r"got the island \[\] in islands="),
    ([[0, 1.0]], TypeError, r"must hold global ranks \(ints\), got 1.0"),
    ([[0, 0]], ValueError, r"the island \[0, 0\] names a rank twice"),
])
def test_islands_of_the_wrong_form_are_refused_with_an_example(groups, error, match):
    with pytest.raises(error, match=match):
        topology.from_groups(groups, [0, 1])


def test_a_mesh_gives_one_island_per_index_of_its_replicate_dimension():
    mesh = [[0, 1], [2, 3]]
    assert topology.from_mesh(mesh, ("replicate", "shard"), range(4)).islands == ((0, 1), (2, 3))
    assert topology.from_mesh(mesh, None, range(4)).islands == ((0, 1), (2, 3))  # HSDP's order: replicate first
    assert topology.from_mesh(mesh, ("shard", "replicate"), range(4)).islands == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match=r"DeviceMesh of shape other than two dimensions"):
        topology.from_mesh([0, 1, 2, 3], ("replicate",), range(4))


def test_one_island_per_host_from_where_each_rank_runs():
    places = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (host, local rank) of ranks 0..3
    assert topology.from_hosts(places, [0, 1, 2, 3]).islands == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match=r"which rank\(s\) \[1\] lack: start the job with torchrun or distopt.launch"):
        topology.from_hosts([(0, 0), None], [0, 1])
    with pytest.raises(ValueError, match=r"hosts run different numbers of ranks \(\[\[0, 1, 2\], \[3\]\]\)"):
        topology.from_hosts([(0, 0), (0, 1), (0, 2), (1, 0)], [0, 1, 2, 3])


def test_the_ranks_disagreement_names_two_views_or_the_first_error():
    a = Topology(((0, 1), (2, 3)))
    b = Topology(((0, 2), (1, 3)))
    assert topology.disagreement([a, a, a]) is None
    assert topology.disagreement([a, a, b]) == (
        "the ranks disagree on the islands: rank 0 has islands=[[0, 1], [2, 3]] and rank 2 has "
        "islands=[[0, 2], [1, 3]]; pass the same islands= on every rank (every rank must build the same islands)")
    assert topology.disagreement([a, "bad islands", b]) == "rank 1: bad islands"


def test_a_process_knows_its_host_from_torchrun_or_distopt_launch(monkeypatch):
    from distopt.launching import placement
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert placement.this_process() is None  # no launcher: the islands must be given
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert placement.this_process() == (4, 1)  # distopt.launch: the host's first rank
    monkeypatch.setenv("GROUP_RANK", "1")
    assert placement.this_process() == (1, 1)  # torchrun: its agent's index
