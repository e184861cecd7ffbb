"""``pack_threshold="auto"``: the pure choice of a pack size from a link's timing."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distopt.planning.link import AUTO_MAX, AUTO_MIN, LinkTiming, choose_threshold, fit_link


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


@given(latency=st.floats(1e-7, 1.0), bandwidth=st.floats(1e3, 1e12), total=st.integers(1, 1 << 40))
def test_the_choice_is_the_balance_of_latency_and_tail_within_bounds(latency, bandwidth, total):
    chosen = choose_threshold(LinkTiming(latency, bandwidth), total)
    assert AUTO_MIN <= chosen <= AUTO_MAX
    best = math.sqrt(max(total, 1) * latency * bandwidth)
    if AUTO_MIN < best < AUTO_MAX:
        assert abs(chosen - best) <= 1
        # the cost (total / s) * latency + s / bandwidth is least there: a neighbour costs no less
        cost = lambda s: total / s * latency + s / bandwidth
        assert cost(chosen) <= min(cost(chosen * 1.5), cost(chosen / 1.5)) * (1 + 1e-9)


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
