"""distopt's collective helpers: in one process without a group, and on real gloo worlds of 1, 2 and 3."""
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import collectives as C
from distopt.planning import packing
from distopt._testing import run_world

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

OPS = ("sum", "mean", "min", "max", "product")


# ---------------------------------------------------------------------------
# one process, no process group: a world of one, same signatures, same checks


@pytest.fixture(autouse=True)
def _no_group():
    assert not dist.is_initialized()


def test_single_process_identity():
    assert (C.get_rank(), C.get_world_size(), C.get_local_rank(), C.get_dist_info()) == (0, 1, 0, (0, 1))
    assert not C.is_distributed()
    C.barrier()
    data = torch.tensor([1.5, -2.0])
    for op in OPS + ("SUM", dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        assert C.all_reduce(data, op=op) is data
    assert data.tolist() == [1.5, -2.0]
    assert C.all_gather(data)[0] is data and len(C.all_gather(data)) == 1
    assert C.gather(data, dst=0)[0] is data
    assert C.broadcast(data, src=0) is data
    objs = ["a", {"b": 1}]
    assert C.broadcast_object_list(objs) is objs and objs == ["a", {"b": 1}]
    assert C.all_gather_object({"x": 1}) == [{"x": 1}]
    assert C.gather_object(3, dst=0) == [3]
    assert C.collect_results([4, 5, 6, 7], 3) == [4, 5, 6]
    assert C.collect_results([4, 5], 2, device="gpu") == [4, 5]

    params = [torch.ones(2), torch.arange(3)]
    C.all_reduce_params(params, op="max")
    C.all_reduce_params(params, coalesce=False, bucket_size_mb=1)
    assert params[0].tolist() == [1.0, 1.0] and params[1].tolist() == [0, 1, 2]

    metrics = {"loss": torch.tensor(2.0), "count": torch.tensor(3)}
    reduced = C.all_reduce_dict(metrics, op="mean")
    assert reduced["loss"] is not metrics["loss"] and reduced["loss"].item() == 2.0
    assert reduced["count"].dtype == torch.get_default_dtype() and reduced["count"].item() == 3.0
    assert metrics["count"].dtype == torch.int64  # inputs are untouched

    C.bcast_list_(params, src=0)
    module = nn.Linear(2, 2)
    before = module.weight.detach().clone()
    C.broadcast_parameters(module)
    C.broadcast_parameters(module.state_dict())
    C.broadcast_parameters(module.parameters(), src=0)
    assert torch.equal(module.weight, before)


def test_single_process_seed_is_fresh_and_follows_numpy():
    seeds = {C.sync_random_seed() for _ in range(5)}
    assert len(seeds) > 1 and all(0 <= s < 2**31 for s in seeds)
    np.random.seed(7)
    first = C.sync_random_seed()
    np.random.seed(7)
    assert C.sync_random_seed() == first


def test_single_process_synchronized_decorator():
    @C.synchronized
    def add(a, b=1):
        """Adds."""
        return a + b

    @C.synchronized(group=None)
    def twice(a):
        return 2 * a

    assert add(1, b=2) == 3 and add.__name__ == "add" and add.__doc__ == "Adds."
    assert twice(4) == 8
    with pytest.raises(TypeError, match="synchronized decorates a function"):
        C.synchronized(3)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: C.all_reduce(torch.ones(1), op="avg"), ValueError, "op must be one of 'sum', 'mean'.*got 'avg'"),
        (lambda: C.all_reduce(torch.ones(1, dtype=torch.int32), op="mean"), TypeError,
         r"op='mean'.*int32.*data.float\(\)"),
        (lambda: C.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND), ValueError, "op must be one of"),
        (lambda: C.all_reduce(torch.ones(1), op=None), ValueError, "op must be one of.*got None"),
        (lambda: C.all_reduce([1.0]), TypeError, "data must be a torch.Tensor, got list"),
        (lambda: C.broadcast(torch.ones(1), src=1), ValueError, "src=1 is out of range for a group of 1 rank"),
        (lambda: C.broadcast(torch.ones(1), src=-1), ValueError, "src=-1 is out of range"),
        (lambda: C.broadcast(torch.ones(1), src="0"), TypeError, "src must be an int rank"),
        (lambda: C.gather(torch.ones(1), dst=2), ValueError, "dst=2 is out of range"),
        (lambda: C.gather_object(1, dst=1), ValueError, "dst=1 is out of range"),
        (lambda: C.broadcast_object_list(("a",)), TypeError, "data must be a list"),
        (lambda: C.broadcast_object_list(["a"], src=3), ValueError, "src=3 is out of range"),
        (lambda: C.bcast_list_([torch.ones(1)], src=1), ValueError, "src=1 is out of range"),
        (lambda: C.bcast_list_(torch.ones(2)), TypeError, "got a single tensor; pass \\[tensor\\]"),
        (lambda: C.all_reduce_params([torch.ones(1), 2.0]), TypeError, r"params\[1\] must be a torch.Tensor"),
        (lambda: C.all_reduce_params([torch.ones(1)], op="nope"), ValueError, "op must be one of"),
        (lambda: C.all_reduce_params([torch.arange(2)], op="mean"), TypeError, "op='mean'"),
        (lambda: C.all_reduce_params([torch.ones(1)], bucket_size_mb=0), ValueError, "bucket_size_mb must be"),
        (lambda: C.all_reduce_dict({"a": 1.0}), TypeError, r"data\['a'\] must be a torch.Tensor"),
        (lambda: C.all_reduce_dict({1: torch.ones(1)}), TypeError, "keys must be strings"),
        (lambda: C.all_reduce_dict({"a": torch.ones(1)}, op="median"), ValueError, "op must be one of"),
        (lambda: C.collect_results([1], 1, device="tpu"), ValueError, "device must be 'cpu' or 'gpu'"),
        (lambda: C.collect_results([1], 1, device="gpu", tmpdir="/tmp"), ValueError, "tmpdir is only used"),
        (lambda: C.collect_results([1], -1), ValueError, "size must be a non-negative int"),
        (lambda: C.collect_results("abc", 1), TypeError, "results must be a list"),
        (lambda: C.broadcast_parameters({"w": torch.ones(1), "step": 3}), TypeError,
         r"params_or_state_dict\['step'\] is a int.*broadcast_object_list"),
    ],
)
def test_single_process_still_validates_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_single_process_collect_results_warns_when_short():
    with pytest.warns(UserWarning, match="got 2 results in all, fewer than size=5"):
        assert C.collect_results([1, 2], 5) == [1, 2]


def test_pack_utilities_are_packings_own():
    for name in ("param_pack_concat", "param_pack_split", "get_offsets"):
        assert getattr(C, name) is getattr(packing, name) is getattr(distopt, name)
    a, b = torch.ones(1, dtype=torch.int32), torch.full((3, 3), 2, dtype=torch.int32)
    offsets = C.get_offsets([a.shape, b.shape])
    assert offsets == [0, 1, 1, 10]
    flat = C.param_pack_concat([a, b], offsets)
    assert flat.tolist() == [1] + [2] * 9
    a2, b2 = C.param_pack_split(flat, offsets, [(1,), (3, 3)])
    assert torch.equal(a2, a) and torch.equal(b2, b)


# ---------------------------------------------------------------------------
# real worlds: every helper on every rank


def _helpers_on_every_rank(tmpdir):
    rank, world = dist.get_rank(), dist.get_world_size()
    expect = {"sum": world * (world + 1) / 2, "mean": (world + 1) / 2, "min": 1.0, "max": float(world),
              "product": float(math.factorial(world))}
    report = {}

    assert (C.get_rank(), C.get_world_size(), C.get_dist_info()) == (rank, world, (rank, world))
    assert C.is_distributed() and C.get_local_rank() == rank
    C.barrier()

    # all_reduce: every op; in place; ints keep their dtype; non-contiguous and view inputs.
    for op in OPS:
        t = torch.tensor([rank + 1.0, 2.0 * (rank + 1)])
        assert C.all_reduce(t, op=op) is t
        assert t.tolist() == pytest.approx([expect[op], 2 * expect[op] if op in ("sum", "mean", "min", "max")
                                            else expect[op] * 2**world])
    ints = torch.tensor([rank + 1], dtype=torch.int64)
    C.all_reduce(ints, op=dist.ReduceOp.MAX)
    assert ints.dtype == torch.int64 and ints.item() == world
    with pytest.raises(TypeError, match="op='mean'"):
        C.all_reduce(torch.tensor([rank]), op="mean")
    base = torch.arange(6.0).view(2, 3) * (rank + 1)
    strided = base.t()
    C.all_reduce(strided)
    assert torch.equal(base, torch.arange(6.0).view(2, 3) * expect["sum"])

    # all_gather / gather: shapes may differ between ranks, results keep them.
    mine = torch.full((rank + 1, 2), float(rank))
    gathered = C.all_gather(mine)
    assert [g.shape for g in gathered] == [(r + 1, 2) for r in range(world)]
    assert all(torch.equal(g, torch.full((r + 1, 2), float(r))) for r, g in enumerate(gathered))
    to_last = C.gather(mine, dst=world - 1)
    if rank == world - 1:
        assert [g.tolist() for g in to_last] == [g.tolist() for g in gathered]
    else:
        assert to_last == []

    # broadcast from the last rank, in place.
    b = torch.tensor([float(rank)] * 3)
    assert C.broadcast(b, src=world - 1) is b and b.tolist() == [world - 1.0] * 3

    # object collectives.
    objs = [f"from {rank}", {"rank": rank}]
    C.broadcast_object_list(objs, src=world - 1)
    assert objs == [f"from {world - 1}", {"rank": world - 1}]
    assert C.all_gather_object(("r", rank)) == [("r", r) for r in range(world)]
    got = C.gather_object(rank * 10, dst=0)
    assert got == ([r * 10 for r in range(world)] if rank == 0 else None)

    # one seed everywhere.
    report["seed"] = C.sync_random_seed()
    assert len(set(C.all_gather_object(report["seed"]))) == 1

    # collect_results: rank r holds items r, r+W, ... of 10 items padded to a multiple of W.
    padded = list(range(10)) + list(range(-world + (10 % world or world), 0))
    part = padded[rank::world]
    for kwargs in ({"device": "cpu"}, {"device": "cpu", "tmpdir": tmpdir}, {"device": "gpu"}):
        collected = C.collect_results(part, 10, **kwargs)
        assert collected == (list(range(10)) if rank == 0 else None), kwargs
    assert os.listdir(tmpdir) == []  # the per-call directory is cleaned up

    # all_reduce_params: mixed dtypes, every coalescing mode.
    for kwargs in ({}, {"bucket_size_mb": 1e-5}, {"coalesce": False}):
        params = [nn.Parameter(torch.full((2, 2), rank + 1.0)), torch.full((3,), rank + 1, dtype=torch.int64),
                  torch.full((1,), rank + 1.0, dtype=torch.float64)]
        C.all_reduce_params(params, **kwargs)
        assert [p.flatten()[0].item() for p in params] == [expect["sum"]] * 3, kwargs
        assert params[1].dtype == torch.int64 and params[0].requires_grad
    floats = [torch.full((2,), rank + 1.0), torch.full((2,), rank + 1.0, dtype=torch.float64)]
    C.all_reduce_params(floats, op="mean")
    assert [f[0].item() for f in floats] == [expect["mean"]] * 2

    # all_reduce_dict: keys matched by name whatever their order; int mean gives floats.
    items = [("loss", torch.tensor(rank + 1.0)), ("count", torch.tensor(rank + 1)), ("vec", torch.ones(3) * rank)]
    metrics = dict(items if rank % 2 == 0 else reversed(items))
    summed = C.all_reduce_dict(metrics)
    assert list(summed) == list(metrics)
    assert summed["loss"].item() == expect["sum"] and summed["count"].item() == expect["sum"]
    assert summed["vec"].tolist() == [world * (world - 1) / 2] * 3
    assert metrics["loss"].item() == rank + 1.0  # inputs untouched
    averaged = C.all_reduce_dict(metrics, op="mean")
    assert averaged["count"].is_floating_point() and averaged["count"].item() == pytest.approx(expect["mean"])

    # bcast_list_ / broadcast_parameters: everything becomes the source rank's.
    tensors = [nn.Parameter(torch.full((2,), float(rank))), torch.full((3,), rank, dtype=torch.int32)]
    C.bcast_list_(tensors, src=world - 1)
    assert tensors[0].tolist() == [world - 1.0] * 2 and tensors[1].tolist() == [world - 1] * 3
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(rank)
    C.broadcast_parameters(model, src=0)
    states = C.all_gather_object({k: v.tolist() for k, v in model.state_dict().items()})
    assert all(s == states[0] for s in states) and states[0]["1.running_mean"] == [0.0] * 4
    sd = {"w": torch.full((2,), float(rank))}
    C.broadcast_parameters(sd, src=world - 1)
    assert sd["w"].tolist() == [world - 1.0] * 2

    @C.synchronized
    def write(value):
        return value + rank

    assert write(1) == 1 + rank
    return report


def _errors_are_the_same_on_every_rank():
    """Mismatches raise one clear error on every rank, and the group stays usable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with pytest.raises(ValueError, match=r"data's \(shape, dtype\) must match on every rank.*\(1,\).*\(2,\)"):
        C.all_reduce(torch.ones(rank + 1))
    with pytest.raises(ValueError, match=r"must match on every rank.*float32.*float64"):
        C.broadcast(torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64))
    with pytest.raises(ValueError, match="data must have one dtype on every rank"):
        C.all_gather(torch.ones(1, dtype=torch.float32 if rank == 0 else torch.int64))
    with pytest.raises(ValueError, match=r"params' \(shape, dtype\) list.*rank 0 has 1 entries and rank 1 has 2"):
        C.all_reduce_params([torch.ones(1)] * (rank + 1))
    with pytest.raises(ValueError, match=r"data's \(key, shape, dtype\) list must match.*'a'.*'b'"):
        C.all_reduce_dict({"a" if rank == 0 else "b": torch.ones(1)})
    with pytest.raises(ValueError, match=f"src={world} is out of range for a group of {world} rank"):
        C.broadcast(torch.ones(1), src=world)
    return C.all_reduce(torch.ones(1)).item()


def _subgroup_ranks_are_group_local():
    """With group=, src/dst/rank count within the group."""
    rank = dist.get_rank()
    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    assert C.get_rank(sub) == rank - 1 and C.get_world_size(sub) == 2
    t = torch.tensor([float(rank)])
    C.broadcast(t, src=1, group=sub)  # group rank 1 is global rank 2
    assert t.item() == 2.0
    C.all_reduce(t, group=sub)
    gathered = C.gather_object(rank, dst=1, group=sub)
    return t.item(), gathered


def _in_world(world, tmpdir):
    report = _helpers_on_every_rank(tmpdir)
    if world > 1:
        assert _errors_are_the_same_on_every_rank() == world
    if world == 3:
        report["sub"] = _subgroup_ranks_are_group_local()
    dist.barrier()
    return report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_helper_on_every_rank(world, tmp_path):
    reports = run_world(_in_world, world, world, str(tmp_path), timeout=150)
    assert len(reports) == world
    assert len({r["seed"] for r in reports}) == 1
    if world == 3:
        assert [r["sub"] for r in reports] == [None, (4.0, None), (4.0, [1, 2])]


def _unpicklable_objects_raise_instead_of_hanging(tmpdir):
    """An object one rank cannot pickle raises TypeError there and wherever it would be received."""
    import threading

    rank, world = dist.get_rank(), dist.get_world_size()
    last = world - 1
    with pytest.raises(TypeError, match=rf"broadcast_object_list: data\[1\] on rank {last} cannot be serialized "
                                        r"\(a lock: TypeError.*every rank of the group raises this error"):
        C.broadcast_object_list(["fine", threading.Lock() if rank == last else None], src=last)
    with pytest.raises(TypeError, match=r"data\[0\] on rank 0 cannot be serialized .*no lambdas"):
        C.broadcast_object_list([lambda: 1])
    with pytest.raises(TypeError, match=r"all_gather_object: the object of rank 1 cannot be serialized \(a lock"):
        C.all_gather_object(threading.Lock() if rank == 1 else rank)
    # gather_object: the rank that failed and the receiver raise; the others receive nothing anyway.
    if rank == 2:
        assert C.gather_object(rank, dst=0) is None
    else:
        message = r"gather_object: the object of rank\(s\) \[1\] cannot be pickled" if rank == 0 else \
            r"gather_object: the object of this rank \(1\) cannot be serialized"
        with pytest.raises(TypeError, match=message):
            C.gather_object(threading.Lock() if rank == 1 else rank, dst=0)
    for kwargs in ({"device": "cpu", "tmpdir": tmpdir}, {"device": "gpu"}):
        with pytest.raises(TypeError, match=r"the (results|object) of rank 1 cannot be serialized"):
            C.collect_results([threading.Lock()] if rank == 1 else [rank], world, **kwargs)
    dist.barrier()
    assert os.listdir(tmpdir) == []  # the failed call's directory is cleaned up
    return C.all_reduce(torch.ones(1)).item()  # nothing was left half-sent: the ranks are in step


@pytest.mark.timeout(200)
def test_an_object_that_cannot_be_pickled_raises_instead_of_hanging(tmp_path):
    assert run_world(_unpicklable_objects_raise_instead_of_hanging, 3, str(tmp_path), timeout=150) == [3.0] * 3
