"""A compressed pack's flags riding in its codec's first all-gather (distopt.engine.carrier), without processes.

The all-gather is simulated: every rank fills its row, and the rows are stacked as the
collective would leave them on every rank.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.compression import AllGather, AllReduce, AllToAll
from distopt.engine.carrier import CARRY_MAX_BYTES, Carrier, carries_flags

PART_DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.int32]
FLAG_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def gather(world, parts, flags):
    """What each rank's carrier holds after the all-gather: every rank's row, in rank order."""
    carriers = [Carrier.fitting(None, flags[r], parts[r], world) for r in range(world)]
    for r in range(world):
        carriers[r].fill(flags[r], parts[r])
    rows = torch.stack([c.send for c in carriers])
    for c in carriers:
        c.rows.copy_(rows)
    return carriers


@settings(max_examples=150, deadline=None)
@given(world=st.integers(1, 5), numel=st.integers(1, 41), part_dtype=st.sampled_from(PART_DTYPES),
       flag_dtype=st.sampled_from(FLAG_DTYPES), nflags=st.integers(1, 13), averaged=st.booleans(),
       seed=st.integers(0, 2**16))
def test_every_rank_gets_every_part_in_rank_order_and_the_flags_sum(world, numel, part_dtype, flag_dtype, nflags,
                                                                   averaged, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, 100, (numel,), generator=g).to(part_dtype) for _ in range(world)]
    flags = [torch.randint(0, 2, (nflags,), generator=g).to(flag_dtype) for _ in range(world)]
    expected_flags = torch.stack([f.double() for f in flags]).sum(0)
    for rank, carrier in enumerate(gather(world, parts, flags)):
        out = torch.full((world * numel,), 7, dtype=part_dtype)
        mine = flags[rank].clone()
        carrier.unpack(mine, out, averaged)
        assert torch.equal(out, torch.cat(parts)), rank
        if averaged:
            assert torch.equal((mine.double() * world).round(), expected_flags)
        else:
            assert torch.equal(mine.double(), expected_flags)


def test_a_carrier_is_reused_while_it_fits_and_replaced_when_it_does_not():
    flags, part = torch.zeros(5), torch.zeros(24, dtype=torch.uint8)
    carrier = Carrier.fitting(None, flags, part, 3)
    assert Carrier.fitting(carrier, flags, part, 3) is carrier
    assert Carrier.fitting(carrier, flags, torch.zeros(25, dtype=torch.uint8), 3) is not carrier
    assert Carrier.fitting(carrier, flags, part, 4) is not carrier
    assert Carrier.fitting(carrier, torch.zeros(6), part, 3) is not carrier


def test_each_part_of_a_row_starts_aligned_for_any_dtype():
    carrier = Carrier.fitting(None, torch.zeros(3), torch.zeros(5, dtype=torch.uint8), 2)
    assert carrier.rows.shape == (2, 32)  # 12 bytes of flags and 5 of part, each padded to 16


def test_only_a_small_all_gather_with_real_flags_carries_them():
    part, flags = torch.zeros(100, dtype=torch.uint8), torch.zeros(4)
    out = torch.zeros(200, dtype=torch.uint8)
    assert carries_flags(AllGather(part, out), flags, 2)
    assert not carries_flags(AllReduce(part), flags, 2)
    assert not carries_flags(AllToAll(part, out), flags, 2)
    assert not carries_flags(AllGather(part, out), torch.zeros(4, dtype=torch.complex64), 2)
    big = torch.zeros(CARRY_MAX_BYTES // 2, dtype=torch.uint8)
    assert not carries_flags(AllGather(big, torch.zeros(2 * big.numel(), dtype=torch.uint8)), flags, 2)
    assert carries_flags(AllGather(big[:-64], torch.zeros(2 * (big.numel() - 64), dtype=torch.uint8)), flags, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_bfloat16_packs_flags_count_exactly(world):
    flags = [torch.tensor([1.0, 0.0, 1.0], dtype=torch.bfloat16) for _ in range(world)]
    parts = [torch.zeros(3, dtype=torch.bfloat16) for _ in range(world)]
    mine = flags[0].clone()
    gather(world, parts, flags)[0].unpack(mine, torch.zeros(3 * world, dtype=torch.bfloat16), averaged=False)
    assert mine.tolist() == [world, 0, world]
