"""A large gradient of mostly zero rows travels as its non-zero rows, and trains like dense.

The capacity rule and the row encoding are checked without processes; three ranks
then train an embedding table and a dense weight against a single-process
reference, through rounds whose rows fit, overflow the capacity (dense that round)
and outgrow the path (dense for a number of rounds that doubles each time, then
tried again).
"""
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distopt import DistributedOptimizer
from distopt.engine import sparse_rows
from distopt._testing import run_world
from distopt.engine.sparse_rows import (MIN_CAP, RETRY_FIRST, RETRY_MAX, capacity_after, dense_round, fill, plan_rows,
                                 retry_after, settle)

from _worlds import Worlds

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
    import distopt.engine.sparse_rows as sr

    old = sr.MIN_ROWS, sr.BUDGET
    sr.MIN_ROWS, sr.BUDGET = 1, 1000.0
    try:
        param = torch.zeros(rows, width, dtype=dtype)
        states = [plan_rows(param, world, rank) for rank in range(world)]
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
        for rank, (state, send) in enumerate(zip(states, sends)):
            assert send.data_ptr() == state.recv.view(world, -1)[rank].data_ptr()  # sent from its own part
        gathered = torch.cat(sends)
        for state in states:
            state.recv.copy_(gathered)
        results = [settle(state, g) for state, g in zip(states, grads)]
        assert results == [fits] * world
        if fits:
            for g in grads:
                assert torch.equal(g, grads[0])  # every rank alike
                torch.testing.assert_close(g, expected)
        assert states[0].cap == states[-1].cap
    finally:
        sr.MIN_ROWS, sr.BUDGET = old


@given(tries=st.integers(1, 20))
def test_the_wait_before_trying_rows_again_doubles_up_to_a_bound(tries):
    waits = [retry_after(0)]
    for _ in range(tries):
        waits.append(retry_after(waits[-1]))
    assert waits[0] == RETRY_FIRST
    assert all(b == min(RETRY_MAX, 2 * a) for a, b in zip(waits, waits[1:])), waits


def test_a_gradient_gone_dense_tries_rows_again_at_its_first_capacity_once_the_wait_is_over():
    state = plan_rows(torch.zeros(2048, 16), world=2)
    first = state.cap
    grad = torch.ones(2048, 16)  # every row non-zero: far more than rows can pay for
    fill(state, grad, None)
    state.recv.view(2, -1).copy_(state.send.repeat(2, 1))  # both ranks sent the same count
    assert not settle(state, grad) and state.cap == 0 and state.send.numel() == 0
    assert state.wait == RETRY_FIRST
    for _ in range(RETRY_FIRST - 1):
        dense_round(state)
        assert state.cap == 0
    dense_round(state)
    assert state.cap == first and state.send.numel() > 0 and state.dense_rounds == 0
    fill(state, grad, None)
    state.recv.view(2, -1).copy_(state.send.repeat(2, 1))
    assert not settle(state, grad) and state.cap == 0 and state.wait == 2 * RETRY_FIRST


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


def _loss(model: Net, rank: int, step: int, sizes=SIZES) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = sizes[step][rank]
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


def _reference(world: int, sizes=SIZES):
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(len(sizes)):
        opt.zero_grad()
        (sum(_loss(model, r, step, sizes) for r in range(world)) / world).backward()
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
        # step 0 probes both matrices (the dense one overflows and goes dense); the table's rows
        # travel until rank 2 has more of them than a quarter of the dense bytes pays for.
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


# ---------------------------------------------------------------------- a rank that is late

#: Ids per rank at each step of the late-rank checks: the table's rows overflow at step 1.
LATE_SIZES = [(20, 20), (20, 100), (20, 20), (20, 20)]


def _late_loss(model: Net, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = LATE_SIZES[step][rank]
    ids = torch.randperm(2048, generator=g)[:n]
    return ((model(ids) - torch.randn(n, 1024, generator=g, dtype=torch.float64)) ** 2).mean()


def _late_reference(skipped: int = -1):
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(len(LATE_SIZES)):
        if step == skipped:
            continue
        opt.zero_grad()
        (sum(_late_loss(model, r, step) for r in range(2)) / 2).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _table_cap(opt: DistributedOptimizer, model: Net) -> int:
    return next(pack.rows.cap for pack in opt._engine.packs if pack.params[0] is model.table.weight)


def _late_rank(then: str):
    """Rank ``step % 2`` of step 1 arrives 2 s late; the other leaves its round pending after 0.5 s.

    ``then="log"``: every rank all-reduces its loss (a collective of its own) before ``step()``,
    while the overflowed rows' dense all-reduce is still to come. ``then="skip"``: every rank
    drops step 1 with ``zero_grad()``, never stepping on it.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                               pack_threshold=1 << 20, stall_timeout=20)
    # Exactly 0.5 s at the end of backward, however slow earlier rounds were: the late rank's 2 s are
    # late by 1.5 s whatever the machine's load.
    opt._engine.backward_patience, opt._engine.patience_growth = 0.5, 0.0
    late = {"log": 0, "skip": 1}[then]  # the late rank: the one that overflows, or the other
    caps = []
    for step in range(len(LATE_SIZES)):
        opt.zero_grad()
        if step == 1 and rank == late:
            time.sleep(2)
        loss = _late_loss(model, rank, step)
        loss.backward()
        if step == 1 and then == "skip":
            opt.zero_grad()
            caps.append(_table_cap(opt, model))
            continue
        if then == "log":
            dist.all_reduce(loss.detach().clone())
        opt.step()
        caps.append(_table_cap(opt, model))
    return [p.detach().clone() for p in model.parameters()], caps


def _local_sgd_join_with_a_table():
    """Local SGD in a join block: rank 1 stops after 3 steps and sends zeros for rank 0's exchanges."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), pack_threshold=1 << 20,
                               sync_every=2, stall_timeout=20)
    with opt.join():
        for step in range(6 if rank == 0 else 3):
            opt.zero_grad()
            _late_loss(model, rank, 0).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], [pack.rows for pack in opt._engine.packs]


#: Ids per rank (two ranks) for the retries: rank 1 touches more of the table than rows pay for
#: at steps 2 and 6.
RETRY_SIZES = [(20, 20), (20, 20), (20, 400), (20, 20), (20, 20), (20, 20), (20, 400)] + [(20, 20)] * 7


def _retrying():
    """Both matrices go dense and try rows again, after 2 dense rounds, then 4 (the bound here)."""
    rank = dist.get_rank()
    saved = sparse_rows.RETRY_FIRST, sparse_rows.RETRY_MAX
    sparse_rows.RETRY_FIRST, sparse_rows.RETRY_MAX = 2, 4
    try:
        torch.manual_seed(0)
        model = Net().double()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                   pack_threshold=1 << 20)
        gathers = []
        for step in range(len(RETRY_SIZES)):
            opt.zero_grad()
            _loss(model, rank, step, RETRY_SIZES).backward()
            gathers.append(opt.stats.gathers)
            opt.step()
    finally:
        sparse_rows.RETRY_FIRST, sparse_rows.RETRY_MAX = saved
    return [p.detach().clone() for p in model.parameters()], gathers


LATE = Worlds({
    "retry": (2, _retrying, ()),
    "log": (2, _late_rank, ("log",)),
    "skip": (2, _late_rank, ("skip",)),
    "local SGD": (2, _local_sgd_join_with_a_table, ()),
}, timeout=WORLD_TIMEOUT)


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_rows_that_overflow_after_a_round_was_left_pending_do_not_block_the_users_own_collective(
        no_leftover_processes):
    results = LATE.results("log")
    reference = _late_reference()
    for params, caps in results:
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert caps[1] == 200, caps  # step 1 overflowed (dense) and the capacity grew
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_zero_grad_settles_a_pending_round_as_the_other_ranks_did(no_leftover_processes):
    results = LATE.results("skip")
    reference = _late_reference(skipped=1)
    assert results[0][1] == results[1][1] and results[0][1][1] == 200, [caps for _, caps in results]
    for params, _ in results:
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_local_sgd_never_sends_rows_so_a_joined_rank_matches_the_exchanges(no_leftover_processes):
    results = LATE.results("local SGD")
    for _, rows in results:
        assert rows and all(r is None for r in rows), rows
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_a_gradient_that_went_dense_tries_rows_again_ever_more_rarely(no_leftover_processes):
    results = LATE.results("retry")
    reference = _reference(2, RETRY_SIZES)
    for params, gathers in results:
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        # The table: rows at 0-2 (2 overflows: dense, wait 2), dense 3-4, rows 5-6 (6 overflows:
        # wait 4), dense 7-10, rows from 11. The dense weight: tries at 0, 3 (after 2 dense
        # rounds), 8 and 13 (after 4, the bound).
        table = [0, 1, 2, 5, 6, 11, 12, 13]
        head = [0, 3, 8, 13]
        assert gathers == [(step in table) + (step in head) for step in range(len(RETRY_SIZES))], gathers
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
