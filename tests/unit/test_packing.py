"""Pack planning, launch ordering and flatten/split, specified without any process."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.planning.packing import (
    LaunchOrder,
    ParamMeta,
    flatten,
    get_offsets,
    grouped_by_owner,
    owner_bounds,
    param_pack_concat,
    param_pack_split,
    plan_packs,
    split,
)

KEYS = [("cpu", "float32", 4), ("cpu", "float64", 8), ("cpu", "float16", 2), ("cpu", "bfloat16", 2), ("cuda:0", "float32", 4)]


@st.composite
def param_sets(draw):
    """Random parameters (key, numel), a registration-independent order and a threshold."""
    n = draw(st.integers(1, 30))
    metas = []
    for _ in range(n):
        device, dtype, itemsize = draw(st.sampled_from(KEYS))
        metas.append(ParamMeta((device, dtype), draw(st.integers(0, 300)), itemsize))
    order = draw(st.permutations(range(n)))
    threshold = draw(st.one_of(st.just(0), st.just(1), st.integers(0, 3000), st.just(10**9)))
    return metas, order, threshold


@settings(max_examples=300, deadline=None)
@given(param_sets())
def test_every_parameter_is_in_exactly_one_pack_and_packs_never_mix_keys(case):
    metas, order, threshold = case
    plan = plan_packs(order, metas, threshold)
    members = [i for pack in plan for i in pack.members]
    assert sorted(members) == list(range(len(metas)))
    for pack in plan:
        assert {metas[i].key for i in pack.members} == {pack.key}
        assert pack.numel == sum(metas[i].numel for i in pack.members)
        assert list(pack.offsets) == [sum(pack.numels[:j]) for j in range(len(pack.members))]


@settings(max_examples=300, deadline=None)
@given(param_sets())
def test_a_pack_closes_as_soon_as_it_reaches_the_threshold(case):
    metas, order, threshold = case
    plan = plan_packs(order, metas, threshold)
    for pack in plan:
        without_last = pack.nbytes - metas[pack.members[-1]].nbytes
        assert without_last < threshold or len(pack.members) == 1
    # Per key, every pack but the last one opened reached the threshold.
    by_key = {}
    for pack in plan:
        by_key.setdefault(pack.key, []).append(pack)
    for packs in by_key.values():
        assert all(p.nbytes >= threshold for p in packs[:-1])


@settings(max_examples=300, deadline=None)
@given(param_sets())
def test_a_parameter_at_or_above_the_threshold_travels_alone(case):
    metas, order, threshold = case
    plan = plan_packs(order, metas, threshold)
    for pack in plan:
        if len(pack.members) > 1:
            assert all(metas[i].nbytes < threshold for i in pack.members)
    # It takes its place in the plan when it arrives, before packs opened earlier that close later.
    big = [i for i in order if metas[i].nbytes >= threshold]
    assert [pack.members[0] for pack in plan if pack.members[0] in big and len(pack.members) == 1] == big


@settings(max_examples=200, deadline=None)
@given(param_sets())
def test_members_keep_the_given_order_within_a_pack(case):
    metas, order, threshold = case
    position = {index: k for k, index in enumerate(order)}
    for pack in plan_packs(order, metas, threshold):
        assert [position[i] for i in pack.members] == sorted(position[i] for i in pack.members)


@settings(max_examples=200, deadline=None)
@given(param_sets(), st.integers(1, 4), st.randoms(use_true_random=False))
def test_packs_grouped_by_owner_keep_their_members_and_give_each_owner_one_contiguous_chunk(case, world, rnd):
    metas, order, threshold = case
    owners = [rnd.randrange(world) for _ in metas]
    specs = plan_packs(order, metas, threshold)
    for plain, grouped in zip(specs, grouped_by_owner(specs, metas, owners)):
        assert sorted(plain.members) == sorted(grouped.members) and plain.numel == grouped.numel
        ranks = [owners[i] for i in grouped.members]
        assert ranks == sorted(ranks)  # by owner, stably
        bounds = owner_bounds(grouped, owners, world)
        assert bounds[0] == 0 and bounds[-1] == grouped.numel
        for i, off, n in zip(grouped.members, grouped.offsets, grouped.numels):
            assert bounds[owners[i]] <= off and off + n <= bounds[owners[i] + 1]


def test_threshold_zero_gives_one_pack_per_parameter():
    metas = [ParamMeta("k", 3, 4), ParamMeta("k", 5, 4), ParamMeta("k", 0, 4)]
    assert [p.members for p in plan_packs([2, 0, 1], metas, 0)] == [(2,), (0,), (1,)]


def test_packs_close_in_order_and_those_still_open_follow_in_the_order_they_were_opened():
    # Nothing may depend on hashing (keys are hashed differently in every process).
    metas = [ParamMeta(("cpu", t), 10, 4) for t in ("a", "b", "a", "b", "a")]
    assert [p.members for p in plan_packs([4, 3, 2, 1, 0], metas, 50)] == [(4, 2), (3, 1), (0,)]
    metas = [ParamMeta(("cpu", t), 10, 4) for t in ("b", "a", "c")]
    assert [p.members for p in plan_packs([0, 1, 2], metas, 1000)] == [(0,), (1,), (2,)]
    assert [p.members for p in plan_packs([2, 1, 0], metas, 1000)] == [(2,), (1,), (0,)]


def test_bad_plan_inputs_are_rejected_with_the_fix():
    metas = [ParamMeta("k", 1, 4)] * 2
    with pytest.raises(ValueError, match="exactly once"):
        plan_packs([0, 0], metas, 10)
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        plan_packs([0, 1], metas, -1)


@st.composite
def rounds(draw):
    """A plan (pack sizes) and, per rank, the members that become ready in some order."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=10))
    tokens = [k for k, size in enumerate(sizes) for _ in range(size)]
    ranks = []
    for _ in range(draw(st.integers(1, 4))):
        subset = draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens)))
        ready = [t for t, keep in zip(tokens, subset) if keep]
        ranks.append(draw(st.permutations(ready)))
    return sizes, ranks


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_every_rank_launches_every_pack_once_in_plan_order_whatever_the_arrival_order(case):
    sizes, ranks = case
    for arrivals in ranks:
        order = LaunchOrder(sizes)
        launched = []
        for pack in arrivals:
            launched += order.ready(pack)
        launched += order.flush()
        assert launched == list(range(len(sizes)))
        assert order.launched == len(sizes)


def test_a_pack_launches_the_moment_it_and_all_earlier_packs_are_complete():
    order = LaunchOrder([2, 1, 1])
    assert order.ready(1) == []  # complete, but pack 0 goes first
    assert order.ready(0) == []
    assert order.ready(0) == [0, 1]
    assert order.ready(2) == [2]
    assert order.flush() == []
    order.reset()
    assert order.launched == 0 and order.flush() == [0, 1, 2]


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3), min_size=1, max_size=6),
)
def test_flatten_then_split_round_trips(dtype, shapes):
    tensors = [torch.arange(torch.Size(s).numel()).reshape(s).to(dtype) for s in shapes]
    flat = flatten(tensors)
    assert flat.dim() == 1 and flat.dtype == dtype
    back = split(flat, tensors)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(tensors, back))
    offsets = get_offsets([t.shape for t in tensors])
    assert torch.equal(param_pack_concat(tensors, offsets), flat)
    assert all(torch.equal(a, b) for a, b in zip(param_pack_split(flat, offsets, [t.shape for t in tensors]), tensors))


def test_split_returns_views_of_the_flat_tensor():
    flat = torch.zeros(5)
    a, b = split(flat, [torch.empty(2), torch.empty(3)])
    b.fill_(1)
    assert flat.tolist() == [0, 0, 1, 1, 1]


def test_offsets_follow_the_begin_end_convention():
    assert get_offsets([(2, 3), (4,), ()]) == [0, 6, 6, 10, 10, 11]


def test_flatten_refuses_mixed_dtypes_and_names_the_fix():
    with pytest.raises(ValueError, match="group them by"):
        flatten([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="at least one tensor"):
        flatten([])


def test_split_refuses_a_flat_tensor_of_the_wrong_size():
    with pytest.raises(ValueError, match="must be 1-D with 4 elements"):
        split(torch.zeros(5), [torch.zeros(4)])


def test_pack_concat_checks_offsets_against_the_tensors():
    with pytest.raises(ValueError, match="get_offsets"):
        param_pack_concat([torch.zeros(3)], [0, 2])
    with pytest.raises(ValueError, match="pair per tensor"):
        param_pack_concat([torch.zeros(3)], [0])
