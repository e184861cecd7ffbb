"""Replanning, specified without any process: from the old plan and what was observed to the new plan."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.planning.packing import ParamMeta, plan_packs
from distopt.planning.replanning import agree_on_unfrozen, observed_order, replan, split_frozen

KEYS = [("cpu", "float32", 4), ("cpu", "float64", 8), ("cuda:0", "float32", 4)]


@st.composite
def plans(draw):
    """Parameters, the plan in reverse registration order, the root's arrivals (a prefix seen) and a threshold."""
    n = draw(st.integers(1, 25))
    metas = []
    for _ in range(n):
        device, dtype, itemsize = draw(st.sampled_from(KEYS))
        metas.append(ParamMeta((device, dtype), draw(st.integers(0, 200)), itemsize))
    arrivals = draw(st.permutations(range(n)))[:draw(st.integers(0, n))]
    threshold = draw(st.one_of(st.just(0), st.integers(1, 2000), st.just(10**9)))
    return metas, list(arrivals), threshold


@settings(max_examples=300, deadline=None)
@given(plans())
def test_the_observed_order_puts_the_arrivals_first_and_every_other_parameter_after_in_reverse(case):
    metas, arrivals, _ = case
    order = observed_order(arrivals, len(metas))
    assert sorted(order) == list(range(len(metas)))
    assert order[:len(arrivals)] == arrivals
    rest = order[len(arrivals):]
    assert rest == sorted(rest, reverse=True)


@settings(max_examples=300, deadline=None)
@given(plans())
def test_replan_keeps_the_old_packs_exactly_when_their_membership_is_unchanged(case):
    metas, arrivals, threshold = case
    old = plan_packs(list(reversed(range(len(metas)))), metas, threshold)
    order = observed_order(arrivals, len(metas))
    new = replan(old, order, metas, threshold)
    planned = plan_packs(order, metas, threshold)
    same = [set(s.members) for s in planned] == [set(s.members) for s in old]
    assert (new is None) == same
    if new is not None:
        assert new == planned  # the new plan is the plan of the observed order, nothing else
        assert sorted(i for spec in new for i in spec.members) == list(range(len(metas)))


@settings(max_examples=100, deadline=None)
@given(plans())
def test_replanning_the_same_order_again_changes_nothing(case):
    metas, arrivals, threshold = case
    order = observed_order(arrivals, len(metas))
    assert replan(plan_packs(order, metas, threshold), order, metas, threshold) is None


def test_an_observed_order_with_a_repeated_or_unknown_index_is_refused():
    with pytest.raises(ValueError, match=r"distinct parameter indices in 0\.\.2, got \[1, 1\]"):
        observed_order([1, 1], 3)
    with pytest.raises(ValueError, match=r"got \[3\]"):
        observed_order([3], 3)


def test_ranks_that_unfroze_the_same_parameters_agree_and_joined_ranks_follow():
    mine = [("fc.weight", "trainable"), ("fc.bias", "frozen, with a gradient set by hand")]
    assert agree_on_unfrozen([mine, None, list(mine)]) == dict(mine)
    assert agree_on_unfrozen([None, None]) == {}
    assert agree_on_unfrozen([[], []]) == {}


def test_ranks_that_unfroze_different_parameters_are_told_which_rank_unfroze_what():
    with pytest.raises(ValueError, match=r"rank 0: \{'fc.weight': 'trainable'\}; rank 2: \{\}.*set requires_grad"):
        agree_on_unfrozen([[("fc.weight", "trainable")], None, []])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=3), unique=True, max_size=12), st.data())
def test_split_frozen_partitions_the_frozen_list_by_what_was_adopted(names, data):
    adopted = {n: "trainable" for n in data.draw(st.lists(st.sampled_from(names), unique=True)) } if names else {}
    track, stay = split_frozen(names, adopted)
    assert sorted(track + stay) == list(range(len(names)))
    assert [names[k] for k in track] == [n for n in names if n in adopted]
    assert all(names[k] not in adopted for k in stay)
