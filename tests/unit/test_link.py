"""``pack_threshold="auto"``: the pure choice of a pack size from a link's timing."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.planning.pack_size import AUTO_MAX, AUTO_MIN, LinkTiming, choose_threshold, fit_link


def test_the_fit_reads_latency_from_small_all_reduces_and_bandwidth_from_the_extra_time_of_large_ones():
    link = fit_link(1024, [0.002, 0.0011, 0.001], 1024 + 10_000_000, [1.2, 1.0011, 1.1])
    assert link.latency == pytest.approx(0.0011)
    assert link.bandwidth == pytest.approx(10_000_000 / 1.0989, rel=1e-6)


def test_a_fit_without_timings_says_so():
    with pytest.raises(ValueError, match="no timings"):
        fit_link(1, [], 2, [1.0])


def test_a_slow_link_between_sites_gets_smaller_packs_than_loopback():
    total = 12 << 20
    loopback = choose_threshold(LinkTiming(latency=50e-6, bandwidth=2e9), total)
    slow = choose_threshold(LinkTiming(latency=300e-6, bandwidth=25e6), total)
    assert AUTO_MIN <= slow < loopback <= AUTO_MAX


def _power_of_two(n):
    return n > 0 and n & (n - 1) == 0


@given(latency=st.floats(1e-7, 1.0), bandwidth=st.floats(1e3, 1e12), total=st.integers(1, 1 << 40))
def test_the_choice_is_the_power_of_two_nearest_the_balance_of_latency_and_tail_within_bounds(
        latency, bandwidth, total):
    chosen = choose_threshold(LinkTiming(latency, bandwidth), total)
    assert _power_of_two(chosen) and AUTO_MIN <= chosen <= AUTO_MAX
    assert chosen <= max(AUTO_MIN, total // 4)  # at least four packs, where the gradients fill them
    best = math.sqrt(max(total, 1) * latency * bandwidth)
    if AUTO_MIN < best < min(AUTO_MAX, total // 4) / 2:
        assert best / math.sqrt(2) * (1 - 1e-9) <= chosen <= best * math.sqrt(2) * (1 + 1e-9)
        # the cost (total / s) * latency + s / bandwidth is least at best: within 7% of it
        cost = lambda s: total / s * latency + s / bandwidth
        assert cost(chosen) <= 1.07 * cost(best)


def _choice(small, large, total=12 << 20):
    return choose_threshold(fit_link(1 << 10, [small], 1 << 20, [large]), total)


@settings(max_examples=500, deadline=None)
@given(small=st.floats(1e-6, 1.0), ratio=st.floats(0.5, 1e4), total=st.integers(1, 1 << 40),
       noise=st.tuples(st.floats(1 / 1.2, 1.2), st.floats(1 / 1.2, 1.2)))
def test_runs_whose_median_timings_differ_by_at_most_20_percent_choose_equal_or_one_power_of_two_apart(
        small, ratio, total, noise):
    large = small * ratio
    one = _choice(small, large, total)
    other = _choice(small * noise[0], large * noise[1], total)
    assert max(one, other) <= 2 * min(one, other), (one, other)


@given(small=st.floats(1e-5, 1e-2), ratio=st.floats(0.5, 1e4), scale=st.floats(0.01, 100.0))
def test_only_the_ratio_of_the_timings_counts_not_how_fast_the_machine_is(small, ratio, scale):
    # The choice reads the link through latency x bandwidth alone: the bytes it moves in one latency.
    fits = [fit_link(1 << 10, [small * k], 1 << 20, [small * ratio * k]) for k in (1.0, scale)]
    assert fits[0].latency * fits[0].bandwidth == pytest.approx(fits[1].latency * fits[1].bandwidth, rel=1e-9)


@pytest.mark.parametrize("ratio", [0.5, 1.0, 1.1, 1.25])
def test_a_large_all_reduce_no_measurably_slower_than_a_small_one_gives_a_bounded_pack_not_the_largest(ratio):
    # Issue 46: on a fast link the 1 MiB timing was not measurably slower than the 1 KiB one,
    # and the choice jumped to 64 MiB for 12 MiB of gradients (all of it in one pack, after backward).
    assert _choice(100e-6, 100e-6 * ratio) == 2 << 20
    assert _choice(100e-6, 100e-6 * ratio, total=256 << 20) == 32 << 20  # sqrt(G x 1 MiB / 0.25), rounded


def test_compressed_packs_grow_by_one_over_the_root_of_the_share_sent():
    link = LinkTiming(latency=300e-6, bandwidth=25e6)
    plain = choose_threshold(link, 12 << 20)
    assert choose_threshold(link, 12 << 20, wire_fraction=1 / 16) == pytest.approx(4 * plain, rel=1e-6)


def test_each_compressor_estimates_the_share_it_sends():
    import torch
    from distopt.compression import Cast, PowerSGD, Quantize
    shapes = [torch.Size([256, 256]), torch.Size([256])]
    assert Cast(torch.float16).wire_fraction(shapes, torch.float32) == 0.5
    assert Quantize(bits=8, block_size=256).wire_fraction(shapes, torch.float32) == pytest.approx((1 + 4 / 256) / 4)
    assert PowerSGD(rank=4).wire_fraction(shapes, torch.float32) == pytest.approx((4 * 512 + 256) / (65536 + 256))
    assert PowerSGD().wire_fraction(shapes, torch.int64) == 1.0
