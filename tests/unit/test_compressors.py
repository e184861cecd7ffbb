"""Compressors without processes: each codec runs for a simulated world of ranks in one process
(:func:`distopt.compression.testing.simulate`, which checks that every rank asks for the same collective
of the same size at the same point, the way the engine's fixed plan requires).
"""
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.compression import (NAMES, AllGather, AllReduce, AllToAll, Cast, Codec, Compressor, PowerSGD, Quantize,
                                 Sign, TopK, resolve)
from distopt.compression.quantize import dequantize_blocks, quantize_blocks
from distopt.compression.testing import CodecWorld, ProtocolError, factor_of, layout_of, mirror, simulate
from distopt.compression.topk import select_largest
from distopt.engine.partial import PartialExchange
from distopt.engine.in_flight import Sent


ROOT = Path(__file__).resolve().parents[2]

#: Every compressor of NAMES that keeps error feedback, by name, small enough for these packs where it has a
#: size: a name added to NAMES runs through the protocol's tests below (bitwise sums, joins, overflows, resumes).
_SMALL = {"powersgd": lambda: PowerSGD(rank=2), "int8": lambda: Quantize(bits=8, block_size=64),
          "int4": lambda: Quantize(bits=4, block_size=64), "topk": lambda: TopK(group_size=16)}
WITH_FEEDBACK = {name: _SMALL.get(name, entry) for name, entry in NAMES.items() if entry().per_rank_keys}
_EACH = dict(argvalues=list(WITH_FEEDBACK.values()), ids=list(WITH_FEEDBACK))


# ---------------------------------------------------------------------------- names and arguments


@pytest.mark.parametrize("name", list(NAMES))
def test_every_name_builds_a_fresh_compressor_that_answers_to_it(name):
    compressor = resolve(name)
    assert isinstance(compressor, Compressor) and compressor.name == name and resolve(name) is not compressor
    assert NAMES[name].sends


def test_the_built_in_compressors_behind_the_names():
    assert [type(NAMES[n]()) for n in ("fp16", "bf16", "int8", "int4", "powersgd", "topk", "sign")] == [
        Cast, Cast, Quantize, Quantize, PowerSGD, TopK, Sign]


def _quoted(text):
    return re.findall(r'`"([a-z0-9]+)"`', text)


def test_every_list_of_compressor_names_is_the_registrys():
    # docs/compression.md's table lists every name, in NAMES' order; the README's row and the other pages'
    # name some of them and point to it; the main job's --compression takes every one. A stale list fails here.
    docs = (ROOT / "docs" / "compression.md").read_text()
    table = [_quoted(line.split("|")[1]) for line in docs.splitlines() if re.match(r'\| `"[a-z0-9]+"`', line)]
    assert [name for row in table for name in row] == list(NAMES)
    readme = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `compression`"))
    modes = next(line for line in (ROOT / "docs" / "modes.md").read_text().splitlines()
                 if line.startswith("| `compression`"))
    for row in (readme, modes):
        assert _quoted(row) and set(_quoted(row)) <= set(NAMES) and "compression.md" in row, row
    main_job = next(line for line in (ROOT / "docs" / "main-job.md").read_text().splitlines()
                    if line.startswith("| `--compression`"))
    assert set(re.findall(r"`([a-z0-9]+)`", main_job)) <= set(NAMES) | {"none", "compression"}
    example = (ROOT / "examples" / "train_digits.py").read_text()
    choices = re.search(r'"--compression", choices=([^,]+, [^)]+\))', example).group(1)
    assert "NAMES" in choices, f"examples/train_digits.py lists its own names: {choices}"


@pytest.mark.parametrize("value, error, match", [
    ("int2", ValueError, r"compression must be None, one of 'fp16'.*got 'int2'"),
    (3, TypeError, r"compression must be None, a name .* got int 3"),
    (PowerSGD, TypeError, r"compression=PowerSGD is a class; pass an instance, e.g. PowerSGD\(\)"),
])
def test_a_bad_compression_names_the_value_and_the_fix(value, error, match):
    with pytest.raises(error, match=match):
        resolve(value)


@pytest.mark.parametrize("build, match", [
    (lambda: PowerSGD(rank=0), r"PowerSGD\(rank=\) must be an int >= 1, got 0"),
    (lambda: PowerSGD(start_step=-1), r"PowerSGD\(start_step=\) must be an int >= 0, got -1"),
    (lambda: Quantize(bits=2), r"Quantize\(bits=\) must be 8 or 4, got 2"),
    (lambda: Quantize(block_size=12), r"Quantize\(block_size=\) must be a positive multiple of 8, got 12"),
    (lambda: Cast(torch.float32), r"Cast\(dtype=\) must be torch.float16 or torch.bfloat16"),
    (lambda: TopK(group_size=48), r"TopK\(group_size=\) must be a power of two from 2 to 256, got 48"),
    (lambda: TopK(group_size=512), r"TopK\(group_size=\) must be a power of two from 2 to 256, got 512"),
    (lambda: TopK(group_size=1), r"TopK\(group_size=\) must be a power of two from 2 to 256, got 1"),
])
def test_bad_compressor_settings_name_the_setting_and_the_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("build, match", [
    (lambda: Quantize(bits=8.0), r"Quantize\(bits=\) must be an int \(8 or 4\), got float 8.0"),
    (lambda: Quantize(bits="8"), r"Quantize\(bits=\) must be an int \(8 or 4\), got str '8'"),
    (lambda: Quantize(bits=True), r"Quantize\(bits=\) must be an int \(8 or 4\), got bool True"),
    (lambda: Quantize(block_size=64.0), r"Quantize\(block_size=\) must be an int .*, got float 64.0"),
    (lambda: PowerSGD(seed="x"), r"PowerSGD\(seed=\) must be an int \(any integer, the same on every rank\), "
                                 r"got str 'x'"),
    (lambda: PowerSGD(seed=1.5), r"PowerSGD\(seed=\) must be an int .*, got float 1.5"),
    (lambda: PowerSGD(rank=2.0), r"PowerSGD\(rank=\) must be an int \(>= 1\), got float 2.0"),
    (lambda: PowerSGD(start_step="10"), r"PowerSGD\(start_step=\) must be an int \(>= 0\), got str '10'"),
    (lambda: PowerSGD(min_compression_rate="2"),
     r"PowerSGD\(min_compression_rate=\) must be a number \(> 0\), got str '2'"),
    (lambda: PowerSGD(min_compression_rate=None), r"PowerSGD\(min_compression_rate=\) must be a number"),
    (lambda: PowerSGD(error_feedback="yes"), r"PowerSGD\(error_feedback=\) must be True or False, got 'yes'"),
    (lambda: TopK(group_size=64.0), r"TopK\(group_size=\) must be an int \(a power of two from 2 to 256\), "
                                    r"got float 64.0"),
    (lambda: Cast("float16"), r"Cast\(dtype=\) must be a torch.dtype \(torch.float16 or torch.bfloat16\), "
                              r"got str 'float16'"),
    (lambda: Cast([torch.float16]), r"Cast\(dtype=\) must be a torch.dtype"),
])
def test_a_compressor_setting_of_the_wrong_type_is_refused_at_construction_naming_it(build, match):
    with pytest.raises(TypeError, match=match):
        build()


def test_powersgd_min_compression_rate_nan_is_out_of_range():
    with pytest.raises(ValueError, match=r"PowerSGD\(min_compression_rate=\) must be > 0, got nan"):
        PowerSGD(min_compression_rate=float("nan"))


@pytest.mark.parametrize("seed", [2**31, 2**63, -2**70])
def test_powersgd_takes_any_int_seed_and_agrees_on_every_rank(seed):
    layout = layout_of([(64, 32)])
    codecs = [PowerSGD(rank=2, seed=seed).codec(layout) for _ in range(2)]
    datas = [torch.randn(2048), torch.randn(2048)]
    simulate(codecs, datas)
    assert torch.equal(datas[0], datas[1])
    # Seeds that worked before draw the Q they drew then.
    like = torch.empty(0)
    old = torch.Generator().manual_seed((12345 * 1_000_003 + 3) * 1_000_033 + 2)
    assert torch.equal(PowerSGD(rank=2, seed=12345).first_q(3, 16, like, step=2),
                       torch.randn(2, 16, generator=old, dtype=torch.float32))


# ---------------------------------------------------------------------------- blockwise quantisation


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 8]), blocks=st.integers(1, 6), seed=st.integers(0, 2**16),
       scale=st.floats(1e-6, 1e6))
def test_blockwise_quantisation_errs_by_at_most_half_a_step_of_each_block(bits, blocks, seed, scale):
    block = 32
    values = torch.randn(blocks * block, generator=torch.Generator().manual_seed(seed)) * scale
    values[::7] = 0.0
    codes, scales = quantize_blocks(values, bits, block)
    assert codes.dtype == torch.uint8 and codes.numel() == values.numel() * bits // 8
    decoded = dequantize_blocks(codes, scales, bits, block, torch.empty_like(values))
    step = scales.repeat_interleave(block)
    assert torch.all((decoded - values).abs() <= step / 2 + 1e-6 * step)
    assert torch.equal(decoded[values == 0], torch.zeros_like(decoded[values == 0]))  # zero is exact


def test_a_block_of_zeros_decodes_to_zeros_without_dividing_by_zero():
    codes, scales = quantize_blocks(torch.zeros(64), 8, 32)
    assert torch.equal(dequantize_blocks(codes, scales, 8, 32, torch.empty(64)), torch.zeros(64))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_block_of_subnormal_values_keeps_its_zeros_exact_and_its_error_feedback_finite(bits):
    # The reciprocal of a subnormal block's scale overflows to inf, and a zero times inf is NaN: a
    # quantiser that multiplies by it poisons the residual of a rank whose gradient has tiny entries.
    values = torch.zeros(64)
    values[3], values[40] = 1e-39, -3e-40  # subnormal in float32
    residual = values.clone()
    codes, scales = quantize_blocks(values, bits, 32, subtract_from=residual)
    decoded = dequantize_blocks(codes, scales, bits, 32, torch.empty(64))
    assert torch.isfinite(decoded).all() and torch.isfinite(residual).all()
    assert torch.equal(decoded[values == 0], torch.zeros(62))
    assert torch.equal(residual, values - decoded)


# ---------------------------------------------------------------------------- codecs in a simulated world


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), bits=st.sampled_from([4, 8]), sizes=st.lists(st.integers(1, 700), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_quantised_sums_are_the_same_bitwise_on_every_rank_and_close_to_the_true_sum(world, bits, sizes, seed):
    layout = layout_of([(n,) for n in sizes])
    gen = torch.Generator().manual_seed(seed)
    datas = [torch.randn(layout.numel, generator=gen) for _ in range(world)]
    truth = sum(d.clone() for d in datas)
    largest = [d.abs().max().item() for d in datas]  # each rank's, before the codecs leave the sum in place
    compressors = [Quantize(bits=bits, block_size=64) for _ in range(world)]
    codecs = [c.codec(layout) for c in compressors]
    trace = simulate(codecs, datas)
    assert all(torch.equal(d, datas[0]) for d in datas)
    top = (1 << (bits - 1)) - 1
    if world <= 2:
        # One all-gather of every rank's whole pack, in bits bits: one quantisation of each rank's values,
        # each off by at most half a step of its block.
        padded = -(-layout.numel // 64) * 64
        assert trace == [("AllGather", padded * bits // 8 + 4 * padded // 64)]
        bound = sum(largest) / top / 2
    else:
        # An all-to-all of the chunks, then an all-gather of their sums: two quantisations.
        assert [kind for kind, _ in trace] == ["AllToAll", "AllGather"]
        bound = (world + 2) * truth.abs().max().item() / top
    assert (datas[0] - truth).abs().max().item() <= bound * (1 + 1e-5) + 1e-6


def _gap_after_rounds(bits, feedback, world=3, rounds=60):
    layout = layout_of([(40,), (300,)])
    compressors = [Quantize(bits=bits, block_size=64) for _ in range(world)]
    codecs = [c.codec(layout) for c in compressors]
    gen = torch.Generator().manual_seed(0)
    sent_total = torch.zeros(layout.numel, dtype=torch.float64)
    true_total = torch.zeros(layout.numel, dtype=torch.float64)
    for _ in range(rounds):
        datas = [torch.randn(layout.numel, generator=gen) + 0.3 for _ in range(world)]
        true_total += sum(d.double() for d in datas)
        simulate(codecs, datas)
        sent_total += datas[0].double()
        if not feedback:
            for c in compressors:
                for r in c.residuals.values():
                    r.zero_()
    return (sent_total - true_total).abs().max().item()


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_makes_what_was_sent_follow_the_true_sum_over_many_rounds(bits):
    # Without feedback the per-round errors add up; with it the gap stays within what the
    # residuals hold at the end: a few quantisation steps, however many rounds.
    with_feedback, without = _gap_after_rounds(bits, True), _gap_after_rounds(bits, False)
    assert with_feedback < without / 4, (with_feedback, without)
    assert with_feedback <= 3 * 4 * 4.0 / ((1 << (bits - 1)) - 1)


# ---------------------------------------------------------------------------- top-k selection


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([2, 16, 64, 256]), groups=st.integers(1, 40), seed=st.integers(0, 2**16),
       scale=st.floats(1e-30, 1e30))
def test_the_selection_finds_each_groups_largest_magnitude(size, groups, seed, scale):
    values = torch.randn(size * groups, generator=torch.Generator().manual_seed(seed)) * scale
    values[::5] = 0.0
    chosen = select_largest(values, size)
    assert chosen.dtype == torch.int32 and chosen.shape == (groups,)
    assert 0 <= int(chosen.min()) and int(chosen.max()) < size
    picked = values.view(size, groups).abs().gather(0, chosen.long().unsqueeze(0)).squeeze(0)
    largest = values.view(size, groups).abs().amax(dim=0)
    # Equal to within the mantissa bits that carry the row: 2^-15 of the largest at 256 rows.
    assert torch.all(picked >= largest * (1 - 2.0 ** -15))


def test_the_selection_takes_nan_and_infinity_over_every_number():
    values = torch.zeros(4, 3)
    values[:, 0] = torch.tensor([1.0, float("nan"), 3.0, -2.0])
    values[:, 1] = torch.tensor([-float("inf"), 5.0, 1e38, 0.0])
    assert select_largest(values.reshape(-1), 4).tolist() == [1, 0, 3]  # the last column: all zeros, a tie


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), size=st.sampled_from([4, 16, 64]),
       sizes=st.lists(st.integers(1, 700), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_topk_sums_are_the_same_bitwise_on_every_rank_and_drop_nothing(world, size, sizes, seed):
    layout = layout_of([(n,) for n in sizes])
    gen = torch.Generator().manual_seed(seed)
    compressors = [TopK(group_size=size) for _ in range(world)]
    codecs = [c.codec(layout) for c in compressors]
    truth = torch.zeros(layout.numel, dtype=torch.float64)
    received = torch.zeros(layout.numel, dtype=torch.float64)
    for _ in range(3):
        datas = [torch.randn(layout.numel, generator=gen) for _ in range(world)]
        truth += sum(d.double() for d in datas)
        trace = simulate(codecs, datas)
        assert all(torch.equal(d, datas[0]) for d in datas)
        received += datas[0].double()
        # One all-gather of each rank's bfloat16 values and one-byte rows, one of each per group.
        groups = -(-layout.numel // (2 * size)) * 2
        assert trace == [("AllGather", 3 * groups)]
        assert (datas[0] != 0).sum() <= world * groups
    # What did not arrive is in the ranks' residuals, to float32 rounding: errors are delayed, never dropped.
    owed = torch.cat([sum(c.residuals[(False, i)].double() for c in compressors) for i in layout.members])
    assert torch.allclose(truth - received, owed, atol=1e-4)


def test_topk_sends_what_piles_up_in_the_residual_once_it_is_the_largest():
    # Padded to 8 values in groups of 4, interleaved: group 0 holds values 0, 2, 4, 6. Value 2 loses to
    # value 0 in one round, then wins with what the round left in its residual.
    layout = layout_of([(4,)])
    codecs = [TopK(group_size=4).codec(layout)]
    arrived = []
    for _ in range(4):
        data = torch.tensor([0.5, 0.0, 0.375, 0.0])
        simulate(codecs, [data])
        arrived.append(data.tolist())
    assert arrived == [[0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.75, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.75, 0.0]]


def test_powersgd_sends_factors_of_matrices_and_the_small_members_exactly():
    world = 2
    layout = layout_of([(64, 32), (32,), (4, 4)])  # a matrix that gains, a vector, a matrix too small to gain
    compressors = [PowerSGD(rank=2) for _ in range(world)]
    codecs = [c.codec(layout) for c in compressors]
    gen = torch.Generator().manual_seed(1)
    datas = [torch.randn(layout.numel, generator=gen) for _ in range(world)]
    truth = sum(d.clone() for d in datas)
    trace = simulate(codecs, datas)
    # First all-reduce: P (64 x 2) plus the 32 + 16 uncompressed values; second: Q (32 x 2).
    assert trace == [("AllReduce", 64 * 2 + 32 + 16), ("AllReduce", 32 * 2)]
    assert all(torch.equal(d, datas[0]) for d in datas)
    assert torch.equal(datas[0][2048:], truth[2048:])  # vector and small matrix: exact sums
    approx = datas[0][:2048].view(64, 32)
    assert torch.linalg.matrix_rank(approx).item() <= 2


def test_powersgd_error_feedback_recovers_a_fixed_gradient_over_rounds():
    # A constant full-rank gradient: rank-1 factors each round, but with feedback and the warm
    # start, the running mean of what arrives converges to the true mean.
    world, rounds = 2, 200
    layout = layout_of([(16, 16)])
    compressors = [PowerSGD(rank=1, min_compression_rate=1.0) for _ in range(world)]
    codecs = [c.codec(layout) for c in compressors]
    gen = torch.Generator().manual_seed(2)
    fixed = [torch.randn(256, generator=gen) for _ in range(world)]
    truth = sum(fixed)
    received = torch.zeros(256)
    for _ in range(rounds):
        datas = [f.clone() for f in fixed]
        simulate(codecs, datas)
        received += datas[0]
    assert (received / rounds - truth).abs().max().item() < 0.1 * truth.abs().max().item()


def test_powersgd_without_feedback_or_warm_start_keeps_no_state_and_still_agrees_on_every_rank():
    layout = layout_of([(64, 32)])
    compressors = [PowerSGD(rank=2, error_feedback=False, warm_start=False) for _ in range(2)]
    codecs = [c.codec(layout) for c in compressors]
    for step in range(3):
        datas = [torch.randn(2048), torch.randn(2048)]
        simulate(codecs, datas, step=step)
        assert torch.equal(datas[0], datas[1])
    assert all(not c.residuals and not c.qs for c in compressors)
    with pytest.raises(TypeError, match=r"PowerSGD\(warm_start=\) must be True or False, got 1"):
        PowerSGD(warm_start=1)


def test_powersgd_before_its_start_step_sends_the_pack_as_it_is():
    layout = layout_of([(64, 32)])
    codecs = [PowerSGD(rank=2, start_step=5).codec(layout) for _ in range(2)]
    datas = [torch.randn(2048), torch.randn(2048)]
    truth = datas[0] + datas[1]
    assert simulate(codecs, datas, step=4) == [("AllReduce", 2048)]
    assert torch.equal(datas[0], truth)
    assert len(simulate(codecs, [torch.randn(2048), torch.randn(2048)], step=5)) == 2


@pytest.mark.parametrize("make", **_EACH)
def test_a_rank_that_has_joined_adds_nothing_and_keeps_its_residual(make):
    layout = layout_of([(64, 32)])
    compressors = [make() for _ in range(2)]
    codecs = [c.codec(layout) for c in compressors]
    simulate(codecs, [torch.randn(2048), torch.randn(2048)])  # both rounds leave residuals
    kept = {k: v.clone() for k, v in compressors[1].residuals.items()}
    live = torch.randn(2048)
    alone = [live.clone(), torch.zeros(2048)]
    simulate(codecs, alone, contributing=[True, False])
    assert all(torch.equal(compressors[1].residuals[k], v) for k, v in kept.items())
    assert torch.equal(alone[0], alone[1])


@pytest.mark.parametrize("counts", [[6, 0], [6, 3], [5, 5, 1], [2, 4, 1]], ids=str)
@pytest.mark.parametrize("make", **_EACH)
def test_what_compression_leaves_out_is_applied_once_at_its_rounds_factor_across_a_join(make, counts):
    # A join block in which rank r contributes to rounds 0 .. counts[r] - 1, then two rounds after it in which
    # every rank does: the engine multiplies each round's sum by world / contributors, expecting the factor
    # the round before had. What was applied, plus what the ranks still owe (their residuals, in applied
    # units), is what was meant: each round's mean over its contributors, every left-out value once.
    # CodecWorld tells each round the factor the engine expects: the last round's while ranks have joined.
    world = len(counts)
    ranks = CodecWorld(make, layout_of([(16, 16), (16,)], dtype=torch.float64), world)
    gen = torch.Generator().manual_seed(sum(counts))
    applied = torch.zeros(ranks.layout.numel, dtype=torch.float64)
    meant = torch.zeros(ranks.layout.numel, dtype=torch.float64)
    for t in range(max(counts) + 2):
        contributing = [t >= max(counts) or count > t for count in counts]
        datas = [torch.randn(ranks.layout.numel, generator=gen, dtype=torch.float64) / world if live
                 else torch.zeros(ranks.layout.numel, dtype=torch.float64) for live in contributing]
        meant += sum(datas) * factor_of(contributing)
        ranks.round(datas, contributing=contributing)  # the same sum on every rank, bitwise (checked)
        applied += datas[0] * factor_of(contributing)
    # PowerSGD keeps float64 residuals for float64 values; the others keep float32 ones.
    tolerance = 1e-10 if isinstance(ranks.compressors[0], PowerSGD) else 1e-6
    assert (applied + ranks.owed() - meant).abs().max().item() < tolerance * meant.abs().max().item()


@pytest.mark.parametrize("make", **_EACH)
def test_an_overflow_reaches_every_rank_and_does_not_poison_the_next_rounds(make):
    layout = layout_of([(64, 32)])
    compressors = [make() for _ in range(2)]
    codecs = [c.codec(layout) for c in compressors]
    bad = torch.randn(2048)
    bad[5] = float("inf")
    datas = [bad, torch.randn(2048)]
    simulate(codecs, datas)
    assert not torch.isfinite(datas[0]).all() and not torch.isfinite(datas[1]).all()
    clean = [torch.randn(2048), torch.randn(2048)]
    simulate(codecs, clean)
    assert torch.isfinite(clean[0]).all() and torch.equal(clean[0], clean[1])


@pytest.mark.parametrize("make", **_EACH)
def test_state_dict_round_trip_continues_bitwise(make):
    layout = layout_of([(64, 32), (10,)])
    gen = torch.Generator().manual_seed(3)
    rounds = [[torch.randn(layout.numel, generator=gen) for _ in range(2)] for _ in range(4)]
    first = [make() for _ in range(2)]
    codecs = [c.codec(layout) for c in first]
    for datas in rounds[:2]:
        simulate(codecs, [d.clone() for d in datas])
    saved = [c.state_dict() for c in first]
    straight = []
    for datas in rounds[2:]:
        ds = [d.clone() for d in datas]
        simulate(codecs, ds)
        straight.append(ds[0])
    resumed = [make() for _ in range(2)]
    for c, state in zip(resumed, saved):
        c.load_state_dict(state)
    codecs = [c.codec(layout) for c in resumed]
    for datas, expected in zip(rounds[2:], straight):
        ds = [d.clone() for d in datas]
        simulate(codecs, ds)
        assert torch.equal(ds[0], expected)


def test_gradients_and_exchanges_keep_their_residuals_apart():
    layout = layout_of([(64, 32)])
    compressors = [Quantize(bits=8, block_size=64) for _ in range(2)]
    codecs = [c.codec(layout) for c in compressors]
    simulate(codecs, [torch.randn(2048), torch.randn(2048)], exchange=True)
    assert {kind for kind, _ in compressors[0].residuals} == {True}


def test_a_user_compressor_needs_only_a_codec():
    class Halves(Compressor):
        def codec(self, layout):
            return _Halves()

    class _Halves:
        def reduce(self, data, round):
            wire = data.to(torch.float16)
            yield AllReduce(wire)
            data.copy_(wire)

    datas = [torch.ones(8), torch.ones(8) * 2]
    simulate([Halves().codec(layout_of([(8,)]))] * 2, datas)
    assert torch.equal(datas[0], torch.full((8,), 3.0))
    assert Halves().settings() == {"compressor": "test_a_user_compressor_needs_only_a_codec.<locals>.Halves"}
    with pytest.raises(ValueError, match="keeps no state"):
        Halves().load_state_dict({"x": 1})


# ---------------------------------------------------------------------------- stages left in an exchange


def test_an_exchange_whose_codecs_are_at_their_last_collective_has_no_stage_left_to_issue():
    # Streaming DiLoCo advances an exchange at each inner step only while a codec has a later stage:
    # a last collective travels on untouched until the merge.
    def exchange(*lasts):
        return PartialExchange([0], [Sent(None, None, 0, 0, False, codec=iter(()), last=last) for last in lasts], [])

    assert not exchange(True).staged()
    assert exchange(False).staged()
    assert exchange(True, False).staged()
    assert not PartialExchange([0], [Sent(None, None, 0, 0, True)], []).staged()  # no codec: the flags, say


# ---------------------------------------------------------------------------- every compressor with error feedback


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("make", **_EACH)
def test_every_rank_holds_the_same_sum_and_the_ranks_owe_what_did_not_arrive(make, world):
    # The protocol's invariant for error feedback: what was meant, less what arrived, is what the residuals hold.
    ranks = CodecWorld(make, layout_of([(24, 20), (20,), (7, 3)]), world)
    gen = torch.Generator().manual_seed(world)
    truth = torch.zeros(ranks.layout.numel, dtype=torch.float64)
    received = torch.zeros_like(truth)
    for _ in range(4):
        datas = [torch.randn(ranks.layout.numel, generator=gen) for _ in range(world)]
        truth += sum(d.double() for d in datas)
        ranks.round(datas)  # checks that every rank's sum is the same, bitwise
        received += datas[0].double()
    assert (truth - received).abs().max() > 1e-3  # compression left something out
    assert torch.allclose(truth - received, ranks.owed(), atol=1e-4)


# ---------------------------------------------------------------------------- signs


def test_sign_sends_each_values_sign_and_its_parameters_mean_magnitude_in_one_all_gather():
    layout = layout_of([(3, 4), (5,)])
    datas = [torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0, 6.0, -1.0, 1.0, 2.0, -2.0, 0.5, 0.5, 4.0, -4.0, 4.0, -4.0, 1.0]),
             torch.full((17,), -0.25)]
    expected = torch.zeros(17)
    for d in datas:  # the first round: no residual yet, so each rank sends mean |x| * sign(x), a zero as +
        for at, n in ((0, 12), (12, 5)):
            x = d[at:at + n]
            expected[at:at + n] += x.abs().mean() * torch.where(x < 0, -1.0, 1.0)
    ranks = CodecWorld(Sign, layout, 2)
    # 17 values pad to 32 bits, 4 bytes, then a float32 scale per parameter.
    assert ranks.round(datas) == [("AllGather", 4 + 2 * 4)]
    assert torch.allclose(datas[0], expected, atol=1e-6)
    assert Sign().wire_fraction([torch.Size((256, 256))], torch.float32) == pytest.approx(1 / 32, rel=1e-3)


@pytest.mark.parametrize("feedback", [True, False])
def test_sign_error_feedback_recovers_a_fixed_gradient_over_rounds(feedback):
    # Signs alone send the same wrong values every round (65% off here); the residuals bring the running
    # mean of what arrives to the true sum, as O(1 / rounds).
    ranks = CodecWorld(Sign, layout_of([(16, 16)]), 2)
    gen = torch.Generator().manual_seed(4)
    fixed = [torch.randn(256, generator=gen) for _ in range(2)]
    received = torch.zeros(256)
    for _ in range(200):
        datas = [f.clone() for f in fixed]
        ranks.round(datas)
        received += datas[0]
        for residual in (r for c in ranks.compressors for r in c.residuals.values() if not feedback):
            residual.zero_()
    truth = sum(fixed)
    off = (received / 200 - truth).norm().item() / truth.norm().item()
    assert off < 0.1 if feedback else off > 0.5


def test_sign_sends_nothing_for_a_rank_that_has_joined_and_a_nan_reaches_only_its_parameter():
    ranks = CodecWorld(Sign, layout_of([(4,), (4,)]), 2)
    datas = [torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0]), torch.randn(8)]
    ranks.round(datas, contributing=[True, False])
    assert torch.equal(datas[0], torch.tensor([1.5, -1.5, 1.5, -1.5, 1.0, 1.0, 1.0, 1.0]))
    poisoned = [torch.tensor([float("nan"), 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]), torch.ones(8)]
    ranks.round(poisoned)
    assert torch.isnan(poisoned[0][:4]).all() and torch.isfinite(poisoned[0][4:]).all()
    assert all(torch.equal(r, torch.zeros_like(r)) for c in ranks.compressors for r in c.residuals.values())


# ---------------------------------------------------------------------------- the simulator


class _Staged(Compressor):
    """A codec whose collectives are chosen by ``choose(data, round)``, for the simulator's own checks."""

    def __init__(self, choose):
        self.choose = choose

    def codec(self, layout):
        choose = self.choose

        class _Codec(Codec):
            def reduce(self, data, round):
                yield from choose(data, round)

        return _Codec()


def _run(choose, world=2, **kwargs):
    codecs = [_Staged(choose).codec(layout_of([(8,)])) for _ in range(world)]
    return simulate(codecs, [torch.randn(8) for _ in range(world)], **kwargs)


def test_the_simulator_refuses_collectives_that_differ_between_ranks():
    def by_values(data, round):  # decided from the values: the ranks' sizes differ
        yield AllReduce(torch.zeros(round.rank + 1), last=True)

    with pytest.raises(ProtocolError, match="the ranks yielded different collectives"):
        _run(by_values)


def test_the_simulator_refuses_a_collective_after_last_and_a_rank_that_ends_early():
    def twice(data, round):
        yield AllReduce(data, last=True)
        yield AllReduce(data, last=True)

    with pytest.raises(ProtocolError, match="after a collective it marked last=True"):
        _run(twice)

    def early(data, round):
        if round.rank == 0:
            yield AllReduce(data)

    with pytest.raises(ProtocolError, match=r"ranks \[1\] ended their round"):
        _run(early)


def test_the_simulator_refuses_sums_that_differ_between_ranks():
    def local(data, round):
        yield AllReduce(data.clone(), last=True)  # the sum is dropped: each rank keeps its own values

    with pytest.raises(ProtocolError, match="rank 1's values differ from rank 0's"):
        _run(local)


def test_the_simulator_gives_zeros_to_a_rank_that_has_joined_and_the_outcome_after_the_first_collective():
    seen = []

    def watch(data, round):
        seen.append((round.rank, round.contributing, bool(data.eq(0).all()), round.outcome.factor))
        gathered = torch.empty(round.world_size * data.numel())
        yield AllGather(data.clone(), gathered)
        seen.append((round.rank, round.final_contributors, round.final_factor, round.outcome.exchange))
        yield AllToAll(torch.zeros(4 * round.world_size), torch.empty(4 * round.world_size), last=True)
        data.copy_(gathered.view(round.world_size, -1).sum(0))

    assert _run(watch, world=3, contributing=[True, False, True], factor=1.0, exchange=True) == [
        ("AllGather", 8), ("AllToAll", 12)]
    assert seen[:3] == [(0, True, False, None), (1, False, True, None), (2, True, False, None)]
    assert seen[3:] == [(r, 2, 1.5, True) for r in range(3)]


def test_mirror_answers_one_ranks_collective_as_if_every_rank_sent_the_same():
    reduce = AllReduce(torch.tensor([1.0, 2.0]))
    mirror(reduce, 3)
    assert reduce.tensor.tolist() == [3.0, 6.0]
    gather = AllGather(torch.tensor([1.0, 2.0]), torch.empty(6))
    mirror(gather, 3)
    assert gather.out.tolist() == [1.0, 2.0] * 3
    swap = AllToAll(torch.tensor([1.0, 2.0, 3.0]), torch.empty(3))
    mirror(swap, 3, rank=1)  # every rank's chunk 1 comes to rank 1
    assert swap.out.tolist() == [2.0, 2.0, 2.0]


def test_a_codec_world_tells_each_round_the_factor_and_step_the_engine_would():
    # Rank 2 joins in round 1, rank 1 in round 2; the block ends and round 3 is whole: the factor expected is the
    # last round's while ranks have joined (learned from its flags), and 1 once every rank contributes again.
    seen = []

    def watch(data, round):
        seen.append((round.rank, round.step, round.factor))
        yield AllReduce(data, last=True)

    ranks = CodecWorld(lambda: _Staged(watch), layout_of([(4,)]), 3)
    for contributing in ([True] * 3, [True, True, False], [True, False, False], [True] * 3):
        ranks.round([torch.ones(4) for _ in range(3)], contributing=contributing)
    assert [(step, factor) for rank, step, factor in seen if rank == 0] == [(0, 1.0), (1, 1.0), (2, 1.5), (3, 1.0)]
