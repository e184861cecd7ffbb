"""Every way a gradient can travel trains alike.

A gradient reaches the wire in one of four ways: moved into its pack's buffer
with the other tiny ones in one ``cat`` when the pack launches; moved into the
buffer by its own hook the moment it is ready (larger members, so autograd's copy
is freed at once); alone in a *direct* pack, all-reduced where autograd left it;
or, alone and mostly zero rows, as its non-zero rows in an all-gather
(:mod:`distopt.sparse_rows`; here every matrix does, from a capacity of 2 rows,
so rounds that overflow it and fall back to a dense all-reduce are covered too). The first
way sends every sum as an all-reduce; the others, all of whose sums are small, as an
all-gather and a local sum. Each case trains the same model once per way in one world, and all must
agree to rounding, with every rank identical, in every mode and on every path: a
parameter used on one rank only, one used on none, accumulation with
``no_sync``, sparse gradients made dense, uneven inputs under ``join()``, sharded
state and local SGD / DiLoCo. The first way is checked against single-process
references in the other test files.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedOptimizer
from distopt.engine import packs, sparse_rows
from distopt._testing import assert_no_children, run_world

WORLD_TIMEOUT = 150

CASES = {
    "plain": {},
    "accumulate with no_sync": {"accumulate": True},
    "sparse as dense": {"sparse": True},
    "join, uneven inputs": {"join": True},
    "shard_state": {"shard_state": True},
    "local SGD": {"sync_every": 2},
    "DiLoCo": {"sync_every": 2, "outer": True},
    "one pack for all but the large": {"threshold": 4096},
}


class Net(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6, sparse=sparse)
        self.fc1 = nn.Linear(6, 128)  # 6 KiB: alone in its pack at a 4 KiB threshold
        self.fc2 = nn.Linear(128, 3)
        self.rank0_only = nn.Parameter(torch.ones(128))  # used on rank 0 only: averaged with zeros
        self.unused = nn.Parameter(torch.ones(4))  # used on no rank: keeps grad None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(self.embed(ids)))
        if dist.get_rank() == 0:
            h = h * self.rank0_only
        return self.fc2(h)


def _loss(model: Net, rank: int, step: int, part: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + part)
    ids = torch.randint(0, 10, (5,), generator=g)
    target = torch.randn(5, 3, generator=g, dtype=torch.float64)
    return ((model(ids) - target) ** 2).mean()


#: (direct packs from this many bytes, tiny members below this mean size moved at launch,
#: direct gradients of this many rows may travel as rows, sums a rank receives this many bytes
#: of travel as an all-gather and a local sum; -1: every sum is an all-reduce)
WAYS = {
    "moved at launch": (1 << 62, 1 << 62, 1 << 62, -1),
    "moved by hooks": (1 << 62, 0, 1 << 62, 1 << 62),
    "direct": (0, 0, 1 << 62, 1 << 62),
    "rows": (0, 0, 1, 1 << 62),
}


def _set_way(way: str) -> None:
    packs.DIRECT_MIN_BYTES, packs._BATCH_GATHER_BELOW, sparse_rows.MIN_ROWS, _ = WAYS[way]
    sparse_rows.MIN_CAP, sparse_rows.BUDGET = 2, 100.0


def _set_transport(opt: DistributedOptimizer, way: str) -> None:
    opt._engine.reconfigure(gather_sum_limit=WAYS[way][3])


def _train(way: str, *, threshold: int = 0, accumulate: bool = False, sparse: bool = False,
           join: bool = False, shard_state: bool = False, sync_every: int = 1, outer: bool = False):
    _set_way(way)
    direct = way in ("direct", "rows")
    torch.manual_seed(0)
    model = Net(sparse).double()
    kwargs = {}
    if outer:
        kwargs["outer_optimizer"] = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pack_threshold=threshold,
        named_parameters=model.named_parameters(), sparse_as_dense=sparse, shard_state=shard_state,
        sync_every=sync_every, **kwargs,
    )
    _set_transport(opt, way)
    rank = dist.get_rank()
    steps = 6 - 3 * rank if join else 6
    kinds = sorted({"direct" if p.direct else "batched" if p.batched else "hooks" for p in opt._engine.packs})
    sent = []
    with opt.join() if join else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            if accumulate:
                with opt.no_sync():
                    _loss(model, rank, step, 1).backward()
            _loss(model, rank, step).backward()
            if direct and sync_every == 1 and not shard_state:
                for pack in opt._engine.packs:  # the averaged gradient is a tensor of its own, not in a buffer
                    grad = pack.params[0].grad
                    if pack.direct and grad is not None and (
                            grad is not pack.views[0] or grad.untyped_storage().nbytes() != grad.nbytes):
                        raise AssertionError(f"{pack.names[0]}: .grad is not the direct pack's own tensor")
            opt.step()
            sent.append((opt.stats.packs, opt.stats.all_reduces + opt.stats.gathers, opt.stats.gathers))
    opt.synchronize()  # the parameters are read outside a forward: shard_state's last share may be on its way
    grads_none = [name for name, p in model.named_parameters() if p.grad is None]
    summed_by_gather = [bool(pack.copies) for pack in opt._engine.packs]  # every pack's sums are small
    return [p.detach().clone() for p in model.parameters()], kinds, sent, grads_none, summed_by_gather


def _default_plan():
    """At the default settings: which packs of a 10 MiB weight and its bias go direct."""
    packs.DIRECT_MIN_BYTES, packs._BATCH_GATHER_BELOW, sparse_rows.MIN_ROWS = 1 << 20, 1 << 12, 1024
    layer = nn.Linear(1024, 2560)
    opt = DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    layer(torch.ones(2, 1024)).sum().backward()
    opt.step()
    return [(pack.direct, [n for n in pack.names]) for pack in opt._engine.packs]


def _complex_gradient_error(way: str) -> float:
    """A complex parameter's averaged gradient against the mean of the ranks' own (computed here)."""
    _set_way(way)
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))
    opt = DistributedOptimizer(torch.optim.SGD([param], lr=0.1), pack_threshold=0)
    _set_transport(opt, way)

    def loss(p: torch.Tensor, rank: int) -> torch.Tensor:
        x = torch.randn(3, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(rank))
        return (p @ x).abs().sum()

    expected = (_plain_grad(param, loss, 0) + _plain_grad(param, loss, 1)) / 2
    loss(param, dist.get_rank()).backward()
    return (param.grad - expected).abs().max().item()


def _plain_grad(param: nn.Parameter, loss, rank: int) -> torch.Tensor:
    copy = param.detach().clone().requires_grad_()
    return torch.autograd.grad(loss(copy, rank), copy)[0]


def _every_way():
    out = {"default plan": _default_plan(), "complex": {way: _complex_gradient_error(way) for way in WAYS}}
    for name, case in CASES.items():
        out[name] = {way: _train(way, **case) for way in WAYS}
    return out


@pytest.fixture(scope="module")
def results():
    # Checked here: the tests' own no_leftover_processes fixture starts after this one, and would
    # count a worker this launch left behind as already there.
    launched = run_world(_every_way, 2, timeout=WORLD_TIMEOUT)
    assert_no_children()
    return launched


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
@pytest.mark.parametrize("way", [w for w in WAYS if w != "moved at launch"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_way_a_gradient_travels_trains_alike(case, way, results, no_leftover_processes):
    per_rank = [r[case] for r in results]
    for rank, ways in enumerate(per_rank):
        params, kinds, sent, grads_none, summed_by_gather = ways[way]
        ref_params, ref_kinds, _, ref_none, ref_summed_by_gather = ways["moved at launch"]
        assert ref_kinds == ["batched"]
        assert not any(ref_summed_by_gather) and all(summed_by_gather), (ref_summed_by_gather, summed_by_gather)
        direct = way in ("direct", "rows")
        assert kinds == (["direct", "hooks"] if direct and "large" in case
                         else ["direct"] if direct else ["hooks"])
        for a, b in zip(params, ref_params):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, (a - b).abs().max())
        assert grads_none == ref_none
        if direct and CASES[case].get("sync_every", 1) == 1:
            # A direct pack's flags travel in an all-reduce of their own.
            assert all(calls > packs_sent for packs_sent, calls, _ in sent if packs_sent)
        gathered = [gathers for _, _, gathers in sent]
        if way == "rows" and CASES[case].get("sync_every", 1) == 1:
            assert all(gathered), gathered  # the embedding's rows, every step
        else:  # exchanged values (local SGD) are never sent as rows
            assert not any(gathered), gathered
    for a, b in zip(per_rank[0][way][0], per_rank[1][way][0]):
        assert torch.equal(a, b)
    if "shard" not in case and "local" not in case.lower() and "DiLoCo" not in case:
        assert "unused" in per_rank[0][way][3]  # used on no rank: no gradient, whichever way


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_at_the_default_settings_a_gradient_of_10_mib_is_sent_where_autograd_left_it(results, no_leftover_processes):
    for per_rank in results:
        assert per_rank["default plan"] == [(True, ["param_groups[0][0]"]), (False, ["param_groups[0][1]"])]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_a_complex_gradient_is_averaged_whichever_way_it_travels(results, no_leftover_processes):
    for per_rank in results:
        assert all(error < 1e-12 for error in per_rank["complex"].values()), per_rank["complex"]
