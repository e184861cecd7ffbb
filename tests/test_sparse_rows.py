"""A large gradient of mostly zero rows travels as its non-zero rows, and trains like dense.

The capacity rule and the row encoding are checked without processes; three ranks
then train an embedding table and a dense weight against a single-process
reference, through rounds whose rows fit, overflow the capacity (dense that round)
and outgrow the path for good (dense from then on).
"""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distopt import DistributedOptimizer
from distopt._testing import run_world
from distopt.sparse_rows import MIN_CAP, capacity_after, fill, plan_rows, settle

WORLD_TIMEOUT = 120


@given(max_cap=st.integers(1, 10_000), largest=st.integers(0, 20_000), data=st.data())
def test_the_capacity_holds_the_largest_count_or_turns_the_path_off(max_cap, largest, data):
    cap = data.draw(st.integers(1, max_cap))  # a capacity never exceeds max_cap
    new = capacity_after(cap, max_cap, largest)
    if largest > max_cap:
        assert new == 0
    else:
        assert largest <= new <= max_cap
        if largest <= cap and 4 * largest >= cap:
            assert new == cap  # no churn while the counts stay near it


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), width=st.integers(1, 5), world=st.integers(2, 4),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), data=st.data())
def test_gathered_rows_sum_to_the_scaled_dense_sum_on_every_rank(rows, width, world, dtype, data):
    import distopt.sparse_rows as sr

    old = sr.MIN_ROWS, sr.BUDGET
    sr.MIN_ROWS, sr.BUDGET = 1, 1000.0
    try:
        param = torch.zeros(rows, width, dtype=dtype)
        states = [plan_rows(param, world) for _ in range(world)]
        grads = []
        for _ in range(world):
            g = torch.zeros(rows, width, dtype=dtype)
            touched = data.draw(st.lists(st.integers(0, rows - 1), max_size=rows))
            g[touched] = torch.randn(len(touched), width).to(dtype)
            grads.append(g)
        scale = 1.0 / world
        expected = sum((g * scale for g in grads), torch.zeros(rows, width, dtype=dtype))
        sends = [fill(state, g, scale) for state, g in zip(states, grads)]
        fits = max(int(torch.count_nonzero(g.ne(0).any(1))) for g in grads) <= states[0].cap
        for state in states:
            state.recv.copy_(torch.cat(sends))
        results = [settle(state, g) for state, g in zip(states, grads)]
        assert results == [fits] * world
        if fits:
            for g in grads:
                assert torch.equal(g, grads[0])  # every rank alike
                torch.testing.assert_close(g, expected)
        assert states[0].cap == states[-1].cap
    finally:
        sr.MIN_ROWS, sr.BUDGET = old


def test_small_matrices_vectors_and_gpu_tensors_stay_dense():
    assert plan_rows(torch.zeros(100, 8), 2) is None  # too few rows
    assert plan_rows(torch.zeros(1 << 20), 2) is None  # not a matrix
    assert plan_rows(torch.zeros(4096, 8, dtype=torch.int64), 2) is None
    assert plan_rows(torch.zeros(4096, 8), 1) is None  # nobody to gather from
    state = plan_rows(torch.zeros(4096, 64), 2)
    assert state is not None and MIN_CAP <= state.cap <= state.max_cap


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # At a 1 MiB pack_threshold both matrices travel alone, where autograd left them.
        self.table = nn.Embedding(2048, 128)  # 2 MiB of float64, mostly zero rows
        self.head = nn.Linear(128, 1024)  # a 1 MiB dense weight, every row non-zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


#: Ids per rank at each step (0: the table is not used there): fits (capacity 64) / overflows on
#: rank 0 (dense that round, capacity grows) / now fits / rank 0 has no gradient / no rank has one /
#: 400 rows on rank 2, beyond what rows can pay for (dense for good) / dense.
SIZES = [(20, 20, 20), (20, 20, 20), (100, 20, 20), (20, 100, 20), (0, 20, 20), (0, 0, 0), (20, 20, 400),
         (20, 20, 20)]


def _loss(model: Net, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = SIZES[step][rank]
    if n == 0:  # the table stays out of the graph: no gradient for it on this rank
        return ((model.head(torch.ones(1, 128, dtype=torch.float64)) - 1) ** 2).mean()
    ids = torch.randperm(2048, generator=g)[:n]
    target = torch.randn(n, 1024, generator=g, dtype=torch.float64)
    return ((model(ids) - target) ** 2).mean()


def _train():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                               named_parameters=model.named_parameters(), pack_threshold=1 << 20)
    log, table_grad_none = [], []
    for step in range(len(SIZES)):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        log.append((opt.stats.gathers, opt.stats.all_reduces))
        table_grad_none.append(model.table.weight.grad is None)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], log, table_grad_none


def _reference(world: int):
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(len(SIZES)):
        opt.zero_grad()
        (sum(_loss(model, r, step) for r in range(world)) / world).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_an_embedding_table_trains_like_one_process_as_rows_overflow_and_go_dense(no_leftover_processes):
    results = run_world(_train, 3, timeout=WORLD_TIMEOUT)
    reference = _reference(3)
    for params, log, table_grad_none in results:
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        gathers = [g for g, _ in log]
        # step 0 probes both matrices (the dense one overflows and stops for good); the table's
        # rows travel until rank 2 has more of them than a quarter of the dense bytes pays for.
        assert gathers == [2, 1, 1, 1, 1, 1, 1, 0], log
        all_reduces = [a for _, a in log]
        # Overflow rounds add one dense all-reduce of the table, at steps 2 and 6.
        assert all_reduces[2] == all_reduces[1] + 1 and all_reduces[6] == all_reduces[5] + 1, log
        # Used on some ranks: averaged with their zeros; used on none: no gradient, as in one process.
        assert table_grad_none == [False] * 5 + [True] + [False] * 2
    for params, _, _ in results[1:]:
        for a, b in zip(params, results[0][0]):
            assert torch.equal(a, b)


def _train_unfreezing(frozen_until: int, distributed: bool):
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = Net().double()
    model.table.weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if distributed:
        opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), pack_threshold=1 << 20)
    gathers = []
    for step in range(4):
        if step == frozen_until:
            model.table.weight.requires_grad_(True)
        opt.zero_grad()
        if distributed:
            _loss(model, rank, step).backward()
            gathers.append(opt.stats.gathers)
        else:
            (sum(_loss(model, r, step) for r in range(2)) / 2).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], gathers


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_a_table_unfrozen_mid_training_travels_as_rows_and_trains_like_one_process(no_leftover_processes):
    results = run_world(_train_unfreezing, 2, 2, True, timeout=WORLD_TIMEOUT)
    reference, _ = _train_unfreezing(2, False)
    for params, gathers in results:
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        # Unfrozen at step 2 (the plan is rebuilt and that round reduced again, the table
        # overflowing its first capacity on rank 0); from step 3 its rows travel alone.
        assert gathers[:2] == [1, 0] and gathers[3] == 1, gathers
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
