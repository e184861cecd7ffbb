"""Streaming local SGD's pure parts, specified without any process: fragments, schedule, merge, packs by group."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.planning.fragments import fragment_of, split_fragments
from distopt.planning.mixing import mix_
from distopt.planning.packing import ParamMeta, plan_packs
from distopt.planning.replanning import replan
from distopt.planning.schedule import StreamSchedule

sizes = st.lists(st.integers(0, 10_000), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 12))
def test_fragments_are_contiguous_nonempty_runs_that_cover_every_parameter_once(nbytes, fragments):
    runs = split_fragments(nbytes, fragments)
    assert len(runs) == min(fragments, len(nbytes))
    assert [i for run in runs for i in run] == list(range(len(nbytes)))
    assert all(len(run) >= 1 for run in runs)
    assert fragment_of(runs) == sorted(fragment_of(runs))


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 12))
def test_no_fragment_holds_more_than_its_share_plus_the_largest_parameter(nbytes, fragments):
    runs = split_fragments(nbytes, fragments)
    if not runs:
        return
    total, largest = sum(nbytes), max(nbytes)
    for run in runs:
        assert sum(nbytes[i] for i in run) <= total / len(runs) + largest


def test_fragments_of_equal_parameters_are_equal_and_one_fragment_is_everything():
    assert split_fragments([4] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_fragments([3, 1, 2], 1) == [range(0, 3)]
    assert split_fragments([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert split_fragments([320, 64, 512, 64, 128, 16], 2) == [range(0, 2), range(2, 6)]  # 384 | 720, not 896 | 208
    assert split_fragments([1, 1, 6, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_fragments([1, 1], 5) == [range(0, 1), range(1, 2)]  # fewer parameters than fragments
    with pytest.raises(ValueError, match="fragments must be an int >= 1, got 0"):
        split_fragments([1], 0)


schedules = st.integers(1, 24).flatmap(
    lambda h: st.tuples(st.just(h), st.integers(1, h), st.integers(0, h - 1)))


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_each_fragment_launches_once_per_period_one_at_a_time_in_fragment_order(case):
    every, fragments, overlap = case
    schedule = StreamSchedule(every, fragments, overlap)
    for start in (0, every, 5 * every):
        launched = [f for s in range(start + 1, start + every + 1) for f in schedule.launches(s)]
        assert sorted(launched) == list(range(fragments))
        assert all(len(schedule.launches(s)) <= 1 for s in range(start + 1, start + every + 1))
    first = [f for s in range(1, every + 1) for f in schedule.launches(s)]
    assert first == list(range(fragments))
    assert schedule.offset(fragments - 1) == every


@settings(max_examples=300, deadline=None)
@given(schedules, st.integers(0, 100))
def test_an_exchange_merges_overlap_steps_after_it_launched_and_before_its_fragment_launches_again(case, step):
    every, fragments, overlap = case
    schedule = StreamSchedule(every, fragments, overlap)
    for f in schedule.launches(step):
        assert f in schedule.merges(step + overlap)
        assert all(f not in schedule.launches(s) for s in range(step + 1, step + overlap + 1))
    # in flight: launched and not merged yet, in launch order
    flying = schedule.in_flight(step)
    for f in flying:
        last = schedule.last_launch(f, step)
        assert last is not None and step - overlap < last <= step
    assert len(flying) == len(set(flying))
    if overlap == 0:
        assert flying == []
    order = schedule.order_after(step)
    assert sorted(order) == list(range(fragments))
    upcoming = [f for s in range(step + 1, step + every + 1) for f in schedule.launches(s)]
    assert upcoming == order


def test_one_fragment_without_overlap_is_plain_sync_every():
    schedule = StreamSchedule(4, 1, 0)
    assert [s for s in range(1, 13) if schedule.launches(s)] == [4, 8, 12]
    assert [s for s in range(1, 13) if schedule.merges(s)] == [4, 8, 12]
    staggered = StreamSchedule(8, 4, 1)
    assert [(s, staggered.launches(s), staggered.merges(s)) for s in range(1, 10)
            if staggered.launches(s) or staggered.merges(s)] == [
        (2, [0], []), (3, [], [0]), (4, [1], []), (5, [], [1]), (6, [2], []), (7, [], [2]), (8, [3], []),
        (9, [], [3])]


@pytest.mark.parametrize("every, fragments, overlap", [(4, 5, 0), (4, 2, 4), (0, 1, 0), (4, 0, 0), (4, 1, -1)])
def test_a_schedule_that_does_not_fit_is_refused(every, fragments, overlap):
    with pytest.raises(ValueError, match="1 <= fragments <= every and 0 <= overlap < every"):
        StreamSchedule(every, fragments, overlap)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=20), st.floats(0.0, 1.0))
def test_the_merge_is_the_papers_convex_combination_and_exact_at_its_ends(values, alpha):
    local = torch.tensor(values, dtype=torch.float64)
    global_ = torch.flip(local, [0]) * 0.5 + 1.0
    mixed = mix_(local.clone(), global_, alpha)
    assert torch.allclose(mixed, alpha * local + (1 - alpha) * global_, rtol=1e-12, atol=1e-9)
    assert torch.equal(mix_(local.clone(), global_, 0.0), global_)
    assert torch.equal(mix_(local.clone(), global_, 1.0), local)


def test_a_merge_factor_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        mix_(torch.zeros(1), torch.zeros(1), 1.5)


@st.composite
def grouped(draw):
    n = draw(st.integers(1, 25))
    metas = [ParamMeta(("cpu", draw(st.sampled_from(["float32", "float64"]))), draw(st.integers(0, 200)), 4)
             for _ in range(n)]
    groups = fragment_of(split_fragments([m.nbytes for m in metas], draw(st.integers(1, 6))))
    order = draw(st.permutations(range(n)))
    threshold = draw(st.one_of(st.just(0), st.integers(1, 2000), st.just(10**9)))
    return metas, groups, list(order), threshold


@settings(max_examples=300, deadline=None)
@given(grouped())
def test_packs_never_mix_groups_and_without_groups_the_plan_is_unchanged(case):
    metas, groups, order, threshold = case
    plan = plan_packs(order, metas, threshold, groups)
    assert sorted(i for pack in plan for i in pack.members) == list(range(len(metas)))
    assert all(len({groups[i] for i in pack.members}) == 1 for pack in plan)
    assert plan_packs(order, metas, threshold, [0] * len(metas)) == plan_packs(order, metas, threshold)
    assert replan(plan, order, metas, threshold, groups) is None


@given(every=st.integers(1, 64), data=st.data())
def test_the_gap_is_the_fewest_steps_between_two_launches(every: int, data: st.DataObject) -> None:
    fragments = data.draw(st.integers(1, every))
    schedule = StreamSchedule(every, fragments)
    launches = [s for s in range(1, 3 * every + 1) if schedule.launches(s)]  # three periods: three launches at least
    assert schedule.gap() == min(b - a for a, b in zip(launches, launches[1:]))
    assert every // fragments <= schedule.gap() <= every
