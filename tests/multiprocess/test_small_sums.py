"""A small sum on CPU travels once (one broadcast from each rank) and is added up locally, in rank order.

Gloo's all-reduce passes the ring twice (reduce-scatter, then all-gather); for a
pack of a few hundred KiB the latency of a pass, not bandwidth, is the cost, so
distopt gathers every rank's copy once and adds them up itself
(:mod:`distopt.rounds`). Every rank adds the same copies in the same order, so the
ranks hold the same bits; at two ranks these are the all-reduce's values. The
rule is pure and checked here without processes; training with it is checked
against one process at three ranks, and against the all-reduce in
``test_pack_paths.py``.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distopt import DistributedOptimizer
from distopt.planning.packing import PackSpec
from distopt.engine.packs import Pack
from distopt.engine.in_flight import GATHER_COPIES_BUDGET, GATHER_SUM_MAX_BYTES, gather_buffer, plan_gathers, sum_copies, sums_by_gather
from distopt._testing import run_world

WORLD_TIMEOUT = 120


@given(world=st.integers(1, 64), nbytes=st.integers(1, 4 << 20))
def test_smaller_sums_and_fewer_ranks_gather_sooner_and_gpus_never(world, nbytes):
    cpu = torch.device("cpu")
    if sums_by_gather(nbytes, world, cpu):
        assert world >= 2
        assert sums_by_gather(nbytes - 1, world, cpu) and (world == 2 or sums_by_gather(nbytes, world - 1, cpu))
    assert not sums_by_gather(nbytes, world, torch.device("cuda", 0))
    assert not sums_by_gather(nbytes, world, cpu, limit=-1)


def test_the_limit_is_what_a_rank_receives():
    cpu = torch.device("cpu")
    assert GATHER_SUM_MAX_BYTES == 512 << 10
    assert sums_by_gather(512 << 10, 2, cpu) and not sums_by_gather((512 << 10) + 1, 2, cpu)
    assert sums_by_gather(256 << 10, 3, cpu) and not sums_by_gather((256 << 10) + 1, 3, cpu)
    assert sums_by_gather(0, 2, cpu) and not sums_by_gather(0, 1, cpu)
    assert sums_by_gather(100, 5, cpu, limit=400) and not sums_by_gather(101, 5, cpu, limit=400)


def test_the_first_small_sums_of_the_plan_gather_while_room_for_their_copies_lasts():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    # room for the other ranks' copies: one at two ranks, two at three
    assert plan_gathers([(100, cpu)] * 7, 2, budget=500) == [True] * 5 + [False] * 2
    assert plan_gathers([(100, cpu)] * 7, 3, budget=500) == [True] * 2 + [False] * 5
    # a sum too large for a gather takes no room; one that would overflow the room is skipped, later small ones not
    assert plan_gathers([(100, cpu), (10**6, cpu), (450, cpu), (300, cpu)], 2, budget=500) == [True, False, False,
                                                                                              True]
    assert plan_gathers([(100, gpu), (100, cpu)], 2, budget=100) == [False, True]
    assert GATHER_COPIES_BUDGET == 4 << 20


@given(sums=st.lists(st.integers(0, 1 << 20), max_size=30), world=st.integers(1, 8),
       budget=st.integers(0, 8 << 20))
def test_the_room_kept_for_copies_never_exceeds_the_budget(sums, world, budget):
    cpu = torch.device("cpu")
    chosen = plan_gathers([(n, cpu) for n in sums], world, budget)
    assert sum((world - 1) * n for n, c in zip(sums, chosen) if c) <= budget
    assert all(sums_by_gather(n, world, cpu) for n, c in zip(sums, chosen) if c)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 6), numel=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_every_rank_adds_the_copies_in_rank_order(world, numel, dtype, seed):
    parts = list((torch.randn(world, numel, generator=torch.Generator().manual_seed(seed)) * 1e3).to(dtype))
    want = functools.reduce(torch.add, parts)
    for rank in range(world):
        others = torch.cat([p for r, p in enumerate(parts) if r != rank])
        into = parts[rank].clone()
        sum_copies(others, into, rank, world)
        assert torch.equal(into, want), rank


def _pack() -> Pack:
    buffer = torch.zeros(8)
    return Pack(PackSpec((torch.device("cpu"), torch.float32), (0,), (0,), (5,), 5, 4), buffer, buffer[:5], [],
                buffer[5:], [], [], False, None, [])


def test_a_pack_keeps_room_for_the_other_ranks_copies_of_each_of_its_sums_from_round_to_round():
    pack = _pack()
    first = gather_buffer(pack, pack.buffer, 3, flags=False)
    assert first.shape == (16,) and first.dtype == torch.float32  # two other ranks' copies of 8
    flags = gather_buffer(pack, pack.flags, 3, flags=True)
    assert flags.shape == (6,)
    assert gather_buffer(pack, pack.buffer, 3, flags=False) is first
    assert gather_buffer(pack, pack.flags, 3, flags=True) is flags
    assert gather_buffer(pack, pack.flags.double(), 3, flags=True).dtype == torch.float64


def test_a_direct_packs_gradient_and_flags_of_one_size_gathered_at_once_have_room_of_their_own():
    # Both are in flight together: one room for the two let the flags' copies overwrite the gradient's
    # (a complex 4x3 gradient is the size of its flags; every rank kept its own gradient).
    pack = _pack()
    gradient, flags = torch.zeros(3), pack.flags
    assert gather_buffer(pack, gradient, 2, flags=False) is not gather_buffer(pack, flags, 2, flags=True)


def _data(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def _train_gathered(world: int, limit: int):
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt._engine.reconfigure(gather_sum_limit=limit)
    for step in range(4):
        x, y = _data(dist.get_rank(), step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    gathered = [bool(pack.copies) for pack in opt._engine.packs]
    return [p.detach().clone() for p in model.parameters()], gathered


def _reference(world: int):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        losses = [nn.functional.mse_loss(model(x), y) for x, y in (_data(r, step) for r in range(world))]
        (sum(losses) / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _both(world: int):
    return {"gathered": _train_gathered(world, GATHER_SUM_MAX_BYTES), "all-reduced": _train_gathered(world, -1)}


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_at_two_ranks_the_gathered_sums_are_the_all_reduces_bit_for_bit(no_leftover_processes):
    per_rank = run_world(_both, 2, 2, timeout=WORLD_TIMEOUT)
    for result in per_rank:
        assert result["gathered"][1] == [True] and result["all-reduced"][1] == [False]
        for a, b in zip(result["gathered"][0], result["all-reduced"][0]):
            assert torch.equal(a, b)


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_three_ranks_summing_by_gather_train_like_one_process_and_like_the_all_reduce(no_leftover_processes):
    per_rank = run_world(_both, 3, 3, timeout=WORLD_TIMEOUT)
    reference = _reference(3)
    for rank, result in enumerate(per_rank):
        params, gathered = result["gathered"]
        assert gathered == [True]
        assert result["all-reduced"][1] == [False]
        for a, b, c in zip(params, result["all-reduced"][0], reference):
            assert torch.allclose(a, c, rtol=0, atol=1e-12), (rank, (a - c).abs().max())
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, (a - b).abs().max())
        for a, b in zip(params, per_rank[0]["gathered"][0]):
            assert torch.equal(a, b)  # every rank added the same copies in the same order
