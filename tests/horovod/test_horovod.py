"""``distopt.horovod``: Horovod's PyTorch API, checked the way Horovod's own tests and examples use it.

Multi-process checks are module-level ``_check_*`` functions that assert on
every rank; each test runs a group of them in one 2-rank gloo world (starting a
world costs seconds). Horovod scripts run under ``torchrun`` in a subprocess.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import inspect
import math
import os
import pkgutil
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import distopt.horovod as hvd
from _worlds import Worlds
from distopt._testing import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "_scripts"
EXAMPLE = ROOT / "examples" / "horovod_migration.py"
HOROVOD_SCRIPTS = [EXAMPLE, SCRIPTS / "hvd_synthetic_benchmark.py", SCRIPTS / "hvd_accumulate.py"]
WORLD_TIMEOUT = 120
TORCHRUN_TIMEOUT = 150


# ====================================================================== helpers run on every rank


def _run_checks(checks: Sequence[Callable[[], None]]) -> List[str]:
    """Run ``checks`` in order on this rank, in a session of their own; return those that ran to the end, by name."""
    hvd.init()
    done = []
    try:
        for check in checks:
            check()
            done.append(check.__name__)
    finally:
        hvd.shutdown()
    return done


def _in_world_of_two(group: str) -> None:
    """Run the checks of ``group`` (of WORLD, below) on 2 ranks; every rank must have run every one of them to the end.

    Starting a world costs seconds: every group runs in one launch, on first use, each in a session of its own.
    """
    _, _, (checks,) = WORLD.checks[group]
    per_rank = WORLD.results(group)
    assert per_rank == [[check.__name__ for check in checks]] * 2, per_rank


def _same_on_all_ranks(value: Any) -> bool:
    return all(v == value for v in hvd.allgather_object(value))


def _digest(obj: Any) -> str:
    """A digest of a (nested) state: tensor values exactly, everything else by repr.

    Values are compared as float64 (exact for every smaller float type) because
    ``load_state_dict`` casts some scalar state (ASGD's ``eta``) to the parameters' dtype.
    """
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, Tensor):
            h.update(str(tuple(x.shape)).encode())
            h.update(x.detach().cpu().double().contiguous().reshape(-1).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def _params_digest(model: nn.Module) -> str:
    return _digest([p for p in model.parameters()])


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(rank: int, step: int = 0, n: int = 6) -> tuple:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64))


def _loss(model: nn.Module, batch: tuple) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _grads(model: nn.Module, batches: Sequence[tuple], scale: float = 1.0) -> List[Tensor]:
    """Local gradients of ``scale * sum of losses`` on a copy of ``model``."""
    clone = copy.deepcopy(model)
    for batch in batches:
        (_loss(clone, batch) * scale).backward()
    return [p.grad.clone() for p in clone.parameters()]


def _close(a: Sequence[Tensor], b: Sequence[Tensor], tol: float = 1e-12) -> bool:
    return all(torch.allclose(x, y, atol=tol, rtol=tol) for x, y in zip(a, b))


# ====================================================================== collectives


def _check_topology() -> None:
    assert hvd.is_initialized()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size(), hvd.cross_rank()) == (2, 2, 1, 0)
    assert hvd.local_rank() == hvd.rank()
    assert hvd.allgather_object(hvd.rank()) == [0, 1]
    assert hvd.gloo_enabled() and not hvd.mpi_enabled()


def _check_allreduce_ops() -> None:
    r = hvd.rank()
    t = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r
    assert torch.equal(hvd.allreduce(t), torch.arange(6.0).view(2, 3) + 5)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), 2 * torch.arange(6.0).view(2, 3) + 10)
    assert torch.equal(hvd.allreduce(t, op=hvd.Min), torch.arange(6.0).view(2, 3))
    assert torch.equal(hvd.allreduce(t, op=hvd.Max), torch.arange(6.0).view(2, 3) + 10)
    assert torch.equal(hvd.allreduce(torch.tensor([2.0 + r]), op=hvd.Product), torch.tensor([6.0]))
    assert torch.equal(t, torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r)  # input untouched
    # Integers average as Horovod's do (truncated), and keep their dtype.
    ints = hvd.allreduce(torch.tensor([3 + r, 10], dtype=torch.int64))
    assert ints.dtype == torch.int64 and ints.tolist() == [3, 10]
    # prescale before the sum, postscale after; Average divides by size on top.
    scaled = hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5)
    assert scaled.tolist() == [3.0, 3.0]
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        assert hvd.allreduce(torch.ones(1), average=False).item() == 2.0
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)


def _check_allreduce_in_place_and_async() -> None:
    r = hvd.rank()
    t = torch.full((3,), float(r))
    assert hvd.allreduce_(t, op=hvd.Sum) is t and t.tolist() == [1.0, 1.0, 1.0]
    # A non-contiguous tensor is reduced through a copy and written back.
    grid = torch.arange(12.0).view(3, 4) * (r + 1)
    column = grid[:, 1]
    hvd.allreduce_(column, op=hvd.Sum)
    assert column.tolist() == [3.0, 15.0, 27.0] and grid[:, 0].tolist() == [0.0, 4.0 * (r + 1), 8.0 * (r + 1)]
    src = torch.full((4,), 2.0 * r)
    handle = hvd.allreduce_async(src)
    out = hvd.synchronize(handle)
    assert hvd.poll(handle) and out.tolist() == [1.0] * 4 and src.tolist() == [2.0 * r] * 4
    assert hvd.synchronize(handle) is out  # a handle can be synchronized again
    in_place = torch.full((2,), float(r))
    assert hvd.synchronize(hvd.allreduce_async_(in_place, op=hvd.Max)) is in_place and in_place.tolist() == [1.0, 1.0]
    tensors = [torch.full((2,), float(r)), torch.full((3,), 2.0 * r)]
    assert [x.tolist() for x in hvd.grouped_allreduce(tensors, op=hvd.Sum)] == [[1.0] * 2, [2.0] * 3]
    assert hvd.grouped_allreduce_(tensors) is not None and tensors[1].tolist() == [1.0] * 3
    with pytest.raises(TypeError, match="optimizer.synchronize"):
        hvd.synchronize(7)


def _check_fp16_compression_does_not_overflow() -> None:
    # 2 x 40000 overflows float16 (max 65504); dividing before the cast keeps the mean exact.
    big = torch.full((5,), 40000.0 + hvd.rank())
    mean = hvd.allreduce(big, compression=hvd.Compression.fp16)
    assert mean.dtype == torch.float32 and torch.isfinite(mean).all()
    assert torch.allclose(mean, torch.full((5,), 40000.5), rtol=1e-3)
    small = torch.linspace(-1, 1, 101, dtype=torch.float64) * (hvd.rank() + 1)
    for compression, tol in ((hvd.Compression.fp16, 5e-3), (hvd.Compression.bf16, 3e-2)):
        out = hvd.allreduce(small, compression=compression, op=hvd.Sum)
        assert out.dtype == torch.float64 and torch.allclose(out, 3 * torch.linspace(-1, 1, 101).double(), atol=tol)


def _check_allgather_and_broadcast() -> None:
    r = hvd.rank()
    gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))
    assert gathered.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert hvd.synchronize(hvd.allgather_async(torch.tensor([r]))).tolist() == [0, 1]
    with pytest.raises(RuntimeError, match=r"Mismatched allgather shapes across ranks \(rank 0: \[\*, 2\], "
                                           r"rank 1: \[\*, 3\]\); every rank must call allgather with a tensor "
                                           r"of the same shape \(but for the first dimension\)"):
        hvd.allgather(torch.zeros(1 + r, 2 + r))
    original = torch.full((3,), float(r))
    copied = hvd.broadcast(original, root_rank=1)
    assert copied.tolist() == [1.0] * 3 and original.tolist() == [float(r)] * 3
    assert hvd.broadcast_(original, 1) is original and original.tolist() == [1.0] * 3
    leaf = torch.full((2,), float(r), requires_grad=True)  # like a parameter
    hvd.broadcast_(leaf, 0)
    assert leaf.tolist() == [0.0, 0.0]
    assert hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), 1)).tolist() == [1]
    with pytest.raises(ValueError, match=r"root_rank must be a rank of the job \(0..1\), got 2"):
        hvd.broadcast(torch.zeros(1), 2)
    assert hvd.broadcast_object({"from": r}, root_rank=1) == {"from": 1}
    assert hvd.allgather_object(("rank", r)) == [("rank", 0), ("rank", 1)]
    hvd.barrier()
    assert hvd.join() in (0, 1)


def _check_mismatched_tensors_raise_on_every_rank() -> None:
    r = hvd.rank()
    with pytest.raises(RuntimeError, match=r"Mismatched allreduce shapes across ranks \(rank 0: \[17, 17\], "
                                           r"rank 1: \[18, 18\]\)"):
        hvd.allreduce(torch.ones(17 + r, 17 + r))
    with pytest.raises(RuntimeError, match=r"Mismatched allreduce shapes .*rank 0: \[17, 1311\], rank 1: \[17, 23, 57\]"):
        hvd.allreduce(torch.ones(17, 23 * 57) if r == 0 else torch.ones(17, 23, 57))  # same size, other shape
    with pytest.raises(RuntimeError, match=r"Mismatched allreduce data types .*rank 0: int32, rank 1: float32"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32 if r == 0 else torch.float32))
    with pytest.raises(RuntimeError, match=r"Mismatched broadcast root ranks .*rank 0: 0, rank 1: 1.*same root_rank"):
        hvd.broadcast(torch.ones(3), root_rank=r)
    with pytest.raises(RuntimeError, match=r"Mismatched allreduce names across ranks \(rank 0: 'loss', rank 1: "
                                           r"'accuracy'\); ranks pair collectives by the order they call them"):
        hvd.allreduce(torch.ones(2), name="loss" if r == 0 else "accuracy")  # swapped calls would pair wrongly
    with pytest.raises(RuntimeError, match=r"Mismatched allreduce reductions across ranks \(rank 0: Average "
                                           r"\(prescale 1.0, postscale 1.0\), rank 1: Sum \(prescale 1.0, "
                                           r"postscale 1.0\)\)"):
        hvd.allreduce(torch.ones(2), op=hvd.Average if r == 0 else hvd.Sum)
    with pytest.raises(RuntimeError, match=r"rank 0: Sum \(prescale 1.0, postscale 1.0\), rank 1: Sum \(prescale 2.0"):
        hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=1.0 + r)
    handle = hvd.broadcast_async(torch.ones(3, 10 * (r + 1)), root_rank=0)
    with pytest.raises(RuntimeError, match=r"Mismatched broadcast shapes"):  # an async op's error: at synchronize
        hvd.synchronize(handle)
    # Nothing was sent: the ranks are still in step.
    assert hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).tolist() == [1.0]


def _check_async_ops_run_in_the_background_and_a_name_in_flight_is_refused() -> None:
    r = hvd.rank()
    if r == 0:  # rank 1 submits its part only after the barrier: this one stays in flight meanwhile
        handle = hvd.allreduce_async(torch.ones(4), name="metric", op=hvd.Sum)
        with pytest.raises(ValueError, match="an operation named 'metric' is still in flight on this rank"):
            hvd.allgather_async(torch.ones(1, 2), name="metric")
        assert not hvd.poll(handle)
    hvd.barrier()  # on the calling thread, while the allreduce waits in the background
    if r == 1:
        handle = hvd.allreduce_async(torch.ones(4), name="metric", op=hvd.Sum)
    mine = torch.tensor([float(r)])
    dist.all_reduce(mine)  # the user's own collective on the default group, meanwhile
    assert hvd.synchronize(handle).tolist() == [2.0] * 4 and mine.tolist() == [1.0]
    assert hvd.poll(handle)
    assert hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), 1, name="metric")).tolist() == [1]  # free again


def _check_prescale_on_integers_truncates_on_each_rank() -> None:
    # Horovod scales integers in float64 and truncates on each rank, before the sum: 2 * int(0.5 * 3) = 2.
    summed = hvd.allreduce(torch.tensor([3, -3], dtype=torch.int32), op=hvd.Sum, prescale_factor=0.5)
    assert summed.dtype == torch.int32 and summed.tolist() == [2, -2]


def _check_int16_travels_on_gloo() -> None:
    # gloo has no int16 kernels; the values travel widened and come back as int16, wrapping like it.
    r = hvd.rank()
    total = hvd.allreduce(torch.tensor([30000, -7 - r], dtype=torch.int16), op=hvd.Sum)
    assert total.dtype == torch.int16 and total.tolist() == [60000 - 65536, -15]
    copied = hvd.broadcast(torch.full((2,), 100 + r, dtype=torch.int16), root_rank=1)
    assert copied.dtype == torch.int16 and copied.tolist() == [101, 101]
    gathered = hvd.allgather(torch.full((r + 1,), r, dtype=torch.int16))
    assert gathered.dtype == torch.int16 and gathered.tolist() == [0, 1, 1]
    assert hvd.ccl_built() is False and hvd.ddl_built() is False


def _check_process_sets() -> None:
    r = hvd.rank()
    evens, odds = hvd.add_process_set([0]), hvd.add_process_set(hvd.ProcessSet([1]))
    both = hvd.add_process_set([1, 0])
    assert (evens.process_set_id, odds.process_set_id) != (None, None) and both.ranks == [0, 1]
    mine = evens if r == 0 else odds
    assert mine.included() and mine.rank() == 0 and mine.size() == 1
    assert (odds if r == 0 else evens).rank() == -1
    assert hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=mine).tolist() == [r + 1.0]
    assert hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=both).tolist() == [3.0]
    assert hvd.allgather(torch.tensor([r]), process_set=mine).tolist() == [r]
    assert hvd.broadcast(torch.tensor([r]), root_rank=1, process_set=both).tolist() == [1]
    assert hvd.allgather_object(r, process_set=both) == [0, 1]
    assert hvd.broadcast_object(r, root_rank=1, process_set=both) == 1
    with pytest.raises(ValueError, match=rf"rank {r} is not in ProcessSet\(process_set_id=\d+, ranks=\[{1 - r}\]\)"):
        hvd.allreduce(torch.ones(1), process_set=odds if r == 0 else evens)
    with pytest.raises(ValueError, match=rf"root_rank {1 - r} is not in the process set \(ranks \[{r}\]\)"):
        hvd.broadcast(torch.ones(1), root_rank=1 - r, process_set=mine)
    with pytest.raises(ValueError, match="exists already"):
        hvd.add_process_set([0])
    hvd.barrier(process_set=both)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=both)
    model(torch.full((1, 3), float(r))).sum().backward()
    assert model.weight.grad.tolist() == [[0.5, 0.5, 0.5]]  # the mean of 0 and 1 over the set
    opt.close()
    # Built for the set of rank 0 on both ranks: rank 1, outside it, trains on its own gradients (Horovod's rule).
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=evens)
    model(torch.full((1, 3), float(r + 1))).sum().backward()
    assert model.weight.grad.tolist() == [[r + 1.0] * 3]
    opt.step()
    opt.close()
    assert hvd.remove_process_set(evens) and not hvd.remove_process_set(evens)
    assert not hvd.remove_process_set(hvd.global_process_set)
    hvd.remove_process_set(odds)
    hvd.remove_process_set(both)


def _check_reducescatter_alltoall_and_grouped_allgather() -> None:
    r = hvd.rank()
    x = torch.arange(10.0).view(5, 2) * (r + 1)  # 5 rows over 2 ranks: rank 0 keeps 3, rank 1 keeps 2
    rows = slice(0, 3) if r == 0 else slice(3, 5)
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), (torch.arange(10.0).view(5, 2) * 3)[rows])
    assert torch.equal(hvd.reducescatter(x), (torch.arange(10.0).view(5, 2) * 1.5)[rows])  # Average by default
    ints = hvd.grouped_reducescatter([torch.full((2,), r + 1), torch.full((4, 1), 2 * r)], op=hvd.Sum)
    assert [t.tolist() for t in ints] == [[3], [[2], [2]]]
    sent = torch.tensor([10 * r + i for i in range(4)])
    assert hvd.alltoall(sent).tolist() == ([0, 1, 10, 11] if r == 0 else [2, 3, 12, 13])
    got, received = hvd.alltoall(torch.tensor([10 * r, 10 * r + 1, 10 * r + 2]), splits=[1, 2])
    assert got.tolist() == ([0, 10] if r == 0 else [1, 2, 11, 12]) and received.tolist() == ([1, 1] if r == 0 else [2, 2])
    with pytest.raises(ValueError, match=r"splits must give 2 non-negative row counts that add up to .*\(3\)"):
        hvd.alltoall(torch.zeros(3), splits=[1, 1])
    with pytest.raises(ValueError, match="divisible by the 2 ranks"):
        hvd.alltoall(torch.zeros(3))
    # Splits wrong on one rank only: every rank raises (before, the others waited for it until the timeout).
    for requires_grad in (False, True):
        with pytest.raises(ValueError, match=r"add up to" if r == 1 else r"rank\(s\) \[1\] do not fit"):
            hvd.alltoall(torch.zeros(3, requires_grad=requires_grad), splits=[1, 2] if r == 0 else [2, 2])
    with pytest.raises(ValueError, match=r"divisible" if r == 0 else r"rank\(s\) \[0\] do not fit"):
        hvd.alltoall(torch.zeros(3 if r == 0 else 4))
    sparse = torch.sparse_coo_tensor([[r, 2]], [1.0 + r, 10.0], (3,))
    reduced = hvd.sparse_allreduce_async(sparse)()  # Average: the mean of both ranks' entries
    assert reduced.is_sparse and reduced.to_dense().tolist() == [0.5, 1.0, 10.0]
    assert hvd.sparse_allreduce_async(sparse, op=hvd.Sum)().to_dense().tolist() == [1.0, 2.0, 20.0]
    with pytest.raises(RuntimeError, match=r"Mismatched alltoall shapes .*rank 0: \[\*, 3\], rank 1: \[\*, 4\]"):
        hvd.alltoall(torch.zeros(2, 3 + r))
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    got, _ = hvd.alltoall(x, splits=[1, 2])
    (got * (r + 1)).sum().backward()  # each row's gradient comes back from the rank it went to
    assert x.grad.tolist() == [1.0, 2.0, 2.0]
    y = torch.full((r + 1,), 1.0, requires_grad=True)
    (hvd.grouped_allgather([y])[0] * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert y.grad.tolist() == ([1.0] if r == 0 else [2.0, 3.0])
    gathered = hvd.grouped_allgather([torch.tensor([r]), torch.full((r + 1, 2), r)])
    assert [t.tolist() for t in gathered] == [[0, 1], [[0, 0], [1, 1], [1, 1]]]


def _check_collective_gradients() -> None:
    r = hvd.rank()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x * (r + 1), op=hvd.Sum).sum().backward()
    assert x.grad.tolist() == [2.0 * (r + 1)] * 3  # d/dx of the summed losses of both ranks
    x = torch.ones(r + 1, 2, requires_grad=True)
    (hvd.allgather(x) * torch.arange(3.0).view(3, 1)).sum().backward()
    assert x.grad.tolist() == ([[0.0, 0.0]] if r == 0 else [[1.0, 1.0], [2.0, 2.0]])  # its rows of the mean
    # reducescatter, by Horovod's rule: the output gradients of every rank gathered, times the size for Sum.
    for op, factor in ((hvd.Sum, 2.0), (hvd.Average, 1.0)):
        x = torch.ones(4, 2, requires_grad=True)
        (hvd.reducescatter(x, op=op, prescale_factor=3.0) * (r + 1)).sum().backward()
        assert x.grad.tolist() == [[3.0 * factor] * 2] * 2 + [[6.0 * factor] * 2] * 2, op
        y = torch.ones(2, 1, requires_grad=True)
        (a,) = hvd.grouped_reducescatter([y], op=op)
        a.sum().backward()
        assert y.grad.tolist() == [[factor], [factor]], op
    x = torch.ones(2, requires_grad=True)
    (hvd.broadcast(x, root_rank=0) * (r + 1)).sum().backward()
    assert x.grad.tolist() == ([1.5, 1.5] if r == 0 else [0.0, 0.0])  # Horovod's: the mean of 1 and 2, on the root


def _check_broadcast_parameters_forms() -> None:
    r = hvd.rank()
    for form in ("state_dict", "named_parameters", "parameters"):
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        with torch.no_grad():
            for t in model.state_dict().values():
                t.fill_(r + 1)
        params = {"state_dict": model.state_dict, "named_parameters": model.named_parameters,
                  "parameters": model.parameters}[form]()  # generators included
        hvd.broadcast_parameters(params, root_rank=1)
        assert all(bool((p == 2).all()) for p in model.parameters()), form
        buffers_from_root = form == "state_dict"
        assert bool((model[1].running_mean == (2 if buffers_from_root else r + 1)).all()), form
    with pytest.raises(ValueError, match="invalid params of type: int"):
        hvd.broadcast_parameters(3, root_rank=0)


def _check_join_stands_in_for_sums_and_refuses_the_rest() -> None:
    r = hvd.rank()
    for first in (0, 1):  # the rank that runs out first
        if r != first:
            assert hvd.allreduce(torch.full((5,), 4.0)).tolist() == [2.0] * 5  # the joined rank adds zeros
            assert hvd.allreduce(torch.tensor([7, 9]), op=hvd.Sum).tolist() == [7, 9]
            assert hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="m")).tolist() == [0.5] * 3
            refused = rf"cannot run while rank\(s\) \[{first}\] have called hvd.join\(\)"
            for call in (lambda: hvd.allgather(torch.ones(2, 2)), lambda: hvd.broadcast(torch.ones(2), r),
                         lambda: hvd.allreduce(torch.ones(2), op=hvd.Max)):
                with pytest.raises(hvd.HorovodInternalError, match=refused):  # as Horovod's
                    call()
        last = hvd.join()
        assert last == 1 - first and hvd.allgather_object(last) == [last, last]
    # With an optimizer: its rounds and a metric's allreduce interleave on the rank still training.
    torch.manual_seed(r)
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    metrics = []
    for step in range(1 if r == 0 else 4):
        opt.zero_grad()
        model(torch.full((2, 3), float(step + r))).sum().backward()
        opt.step()
        metrics.append(hvd.allreduce(torch.tensor([2.0])).item())
    assert hvd.join() == 1
    assert metrics == [2.0] + [1.0] * (len(metrics) - 1)  # the joined rank's zero counts from step 2 on
    for p in model.parameters():
        gathered = hvd.allgather(p.detach().reshape(1, -1))
        assert torch.equal(gathered[0], gathered[1])



def _uneven_steps(opt: Any, model: nn.Module, steps: int) -> None:
    for step in range(steps):
        opt.zero_grad()
        model(torch.full((2, 3), float(step))).sum().backward()
        opt.step()


def _check_join_counts_only_the_optimizers_every_rank_holds() -> None:
    r = hvd.rank()
    torch.manual_seed(0)
    dropped, kept = nn.Linear(3, 1), nn.Linear(3, 2)
    dropped_opt = hvd.DistributedOptimizer(torch.optim.SGD(dropped.parameters(), lr=0.1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(kept.parameters(), lr=0.1))
    if r == 0:
        dropped_opt.close()  # on one rank only: its rounds can no longer pair
    _uneven_steps(opt, kept, 1 if r == 0 else 3)
    with pytest.raises(hvd.HorovodInternalError, match=(  # the same error on every rank
            r"hvd.join\(\) needs the same optimizers on every rank, and they differ: hvd.DistributedOptimizer "
            r"#\d+ \(the \d+(st|nd|rd|th) built since hvd.init\(\); 2 parameter tensors, 4 elements\) is alive on "
            r"rank 1 but not on rank 0, where it was closed or garbage-collected \(or never built\). hvd.join\(\) "
            r"left it out. Keep each hvd.DistributedOptimizer alive on every rank while any rank steps it, and "
            r"close\(\) \(or drop\) it on every rank alike, before hvd.join\(\)")):
        hvd.join()
    gathered = hvd.allgather(kept.weight.detach().reshape(1, -1))  # the optimizers held alike were joined
    assert torch.equal(gathered[0], gathered[1])
    dropped_opt.close()  # now closed on every rank, and still referenced: left out of the join
    _uneven_steps(opt, kept, 2 if r == 0 else 1)
    assert hvd.join() == 0
    opt.close()


COLLECTIVES = [
    _check_topology,
    _check_allreduce_ops,
    _check_allreduce_in_place_and_async,
    _check_fp16_compression_does_not_overflow,
    _check_allgather_and_broadcast,
    _check_mismatched_tensors_raise_on_every_rank,
    _check_async_ops_run_in_the_background_and_a_name_in_flight_is_refused,
    _check_int16_travels_on_gloo,
    _check_prescale_on_integers_truncates_on_each_rank,
    _check_process_sets,
    _check_reducescatter_alltoall_and_grouped_allgather,
    _check_collective_gradients,
    _check_broadcast_parameters_forms,
    _check_join_stands_in_for_sums_and_refuses_the_rest,
    _check_join_counts_only_the_optimizers_every_rank_holds,
]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_collectives_follow_horovod_semantics(no_leftover_processes):
    _in_world_of_two("collectives")


# ====================================================================== as horovod.torch: signatures, scaling, errors, dtypes


def _check_reducescatter_takes_compression_in_horovods_slot() -> None:
    r = hvd.rank()
    t = torch.ones(4, 1) * (r + 1)
    positional = hvd.reducescatter(t, "rs", hvd.Compression.none, hvd.Sum)  # name, compression, op
    assert positional.tolist() == [[3.0], [3.0]]
    (grouped,) = hvd.grouped_reducescatter([t], None, hvd.Compression.none, hvd.Sum)
    assert grouped.tolist() == [[3.0], [3.0]]
    # fp16 on the wire, the input's dtype back; Average divides before the cast, so 2 x 40000 cannot overflow.
    big = torch.full((2, 3), 40000.0 + r, dtype=torch.float64)
    mean = hvd.reducescatter(big, compression=hvd.Compression.fp16)
    assert mean.dtype == torch.float64 and torch.allclose(mean, torch.full((1, 3), 40000.5, dtype=torch.float64),
                                                          rtol=1e-3)
    (summed,) = hvd.grouped_reducescatter([t], compression=hvd.Compression.fp16, op=hvd.Sum)
    assert summed.dtype == torch.float32 and summed.tolist() == [[3.0], [3.0]]
    x = torch.ones(4, 2, requires_grad=True)  # differentiable with compression too
    (hvd.reducescatter(x, compression=hvd.Compression.fp16, op=hvd.Sum) * (r + 1)).sum().backward()
    assert x.grad.tolist() == [[2.0] * 2] * 2 + [[4.0] * 2] * 2


def _check_integer_average_scales_the_sum_once_by_postscale_over_size() -> None:
    # Horovod: Average of integers is the sum times postscale / size, truncated once: 3 * 3 / 2 = 4.5 -> 4.
    r = hvd.rank()
    mean = hvd.allreduce(torch.tensor([1 + r], dtype=torch.int32), postscale_factor=3.0)
    assert mean.dtype == torch.int32 and mean.tolist() == [4]
    in_place = torch.tensor([1 + r, -1 - r])
    assert hvd.allreduce_(in_place, op=hvd.Average, postscale_factor=3.0) is in_place
    assert in_place.tolist() == [4, -4]
    assert hvd.reducescatter(torch.tensor([1 + r, 1 + r]), postscale_factor=3.0).tolist() == [4]
    # Sum with a postscale scales in float64 and truncates once too: 7 * 0.5 = 3.5 -> 3.
    assert hvd.allreduce(torch.tensor([3 + r]), op=hvd.Sum, postscale_factor=0.5).tolist() == [3]
    # Without a postscale the mean stays exact integer division, truncated toward zero.
    assert hvd.allreduce(torch.tensor([2**61 + 1, -3 - r])).tolist() == [2**61 + 1, -3]  # float64 would lose it


def _check_alltoall_async_synchronizes_to_output_and_received_splits() -> None:
    r = hvd.rank()
    output, received = hvd.synchronize(hvd.alltoall_async(torch.tensor([10 * r, 10 * r + 1])))
    assert output.tolist() == [r, 10 + r] and received.dtype == torch.int32 and received.tolist() == [1, 1]
    output, received = hvd.synchronize(hvd.alltoall_async(torch.tensor([r, r, r]), splits=torch.tensor([1, 2])))
    assert output.tolist() == ([0, 1] if r == 0 else [0, 0, 1, 1]) and received.tolist() == [1 + r, 1 + r]
    # alltoall itself, as Horovod's: the output alone without splits, with them also the counts.
    assert isinstance(hvd.alltoall(torch.tensor([r, r])), Tensor)
    assert isinstance(hvd.alltoall(torch.tensor([r, r]), splits=[1, 1]), tuple)


def _check_failed_collectives_raise_horovod_internal_error() -> None:
    r = hvd.rank()
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched allreduce shapes across ranks \(rank 0: \[2\], "
                                                       r"rank 1: \[3\]\); every rank must call allreduce"):
        hvd.allreduce(torch.ones(2 + r))
    handle = hvd.allgather_async(torch.ones(1, 2 + r))
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched allgather shapes"):
        hvd.synchronize(handle)
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched reducescatter shapes"):
        hvd.reducescatter(torch.ones(2, 1 + r))
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched broadcast root ranks"):
        hvd.broadcast_(torch.ones(1), root_rank=r)
    # Misuse found before anything is sent stays a ValueError, as Horovod's argument checks are.
    with pytest.raises(ValueError, match="divisible by the 2 ranks"):
        hvd.alltoall(torch.zeros(3))
    assert hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).tolist() == [1.0]  # still in step


def _check_complex_reduces_and_wrong_dtypes_are_refused_on_every_rank() -> None:
    r = hvd.rank()
    assert hvd.allreduce(torch.tensor([1 + 1j * r])).tolist() == [1 + 0.5j]
    assert hvd.allreduce(torch.tensor([1 + 1j * r]), op=hvd.Sum, prescale_factor=2.0).tolist() == [4 + 2j]
    assert hvd.allreduce(torch.tensor([1j * r], dtype=torch.complex128), postscale_factor=4.0).tolist() == [2j]
    assert hvd.reducescatter(torch.tensor([1j * r, 1.0 + r])).tolist() == ([0.5j] if r == 0 else [1.5 + 0j])
    assert hvd.allreduce(torch.tensor([True, bool(r)]), op=hvd.Max).tolist() == [True, True]  # any rank
    assert hvd.allreduce(torch.tensor([True, bool(r)]), op=hvd.Min).tolist() == [True, False]  # every rank
    refused = [
        (lambda: hvd.allreduce(torch.tensor([1j]), op=hvd.Max), r"op=hvd.Max is not supported for complex64"),
        (lambda: hvd.allreduce(torch.tensor([1j]), op=hvd.Product), r"op=hvd.Product is not supported for complex"),
        (lambda: hvd.allreduce(torch.tensor([True])), r"op=hvd.Average is not supported for bool tensors.*tensor.int"),
        (lambda: hvd.allreduce_(torch.tensor([True]), op=hvd.Sum), r"op=hvd.Sum is not supported for bool"),
        (lambda: hvd.reducescatter(torch.tensor([True, False])), r"hvd.reducescatter with op=hvd.Average"),
        (lambda: hvd.allreduce(torch.tensor([True]), op=hvd.Max, prescale_factor=2.0), "takes no scale factors"),
        (lambda: hvd.allreduce(torch.ones(2, dtype=torch.uint16), op=hvd.Sum),
         r"Tensor type uint16 is not supported by hvd.allreduce; cast it"),
        (lambda: hvd.synchronize(hvd.allreduce_async(torch.tensor([False]))), "not supported for bool"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    # A refused dtype on one rank only: the ranks' dtypes differ, and every rank says so instead of hanging.
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched allreduce data types .*complex64.*float32"):
        hvd.allreduce(torch.tensor([1j]) if r == 0 else torch.tensor([1.0]), op=hvd.Max)
    assert hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).tolist() == [1.0]  # nothing was sent


def _check_objects_travel_by_cloudpickle_and_a_failure_raises_on_every_rank() -> None:
    import sys
    import threading

    r = hvd.rank()
    scale = 3
    schedule = hvd.broadcast_object({"lr_lambda": lambda epoch: 0.1 * scale ** epoch} if r == 0 else None, 0)
    assert schedule["lr_lambda"](2) == pytest.approx(0.9)  # a closure, as Horovod's cloudpickle sends it

    def local(x: int) -> int:
        return x + r

    assert [f(10) for f in hvd.allgather_object(local)] == [10, 11]
    unpicklable = r"broadcast_object: obj on rank 0 cannot be serialized \(a lock: TypeError"
    with pytest.raises(TypeError, match=unpicklable + r".*every rank of the group raises this error"):
        hvd.broadcast_object(threading.Lock() if r == 0 else None, root_rank=0)
    with pytest.raises(TypeError, match=r"allgather_object: the object of rank 1 cannot be serialized"):
        hvd.allgather_object(threading.Lock() if r == 1 else r)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "cloudpickle", None)  # as if not installed: pickle, which cannot send a lambda
        with pytest.raises(TypeError, match=r"obj on rank 1 cannot be serialized .*pip install cloudpickle"):
            hvd.broadcast_object(lambda: 1, root_rank=1)
        assert hvd.broadcast_object({"plain": r}, root_rank=1) == {"plain": 1}
    assert hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).tolist() == [1.0]  # still in step


SIGNATURES = [
    _check_reducescatter_takes_compression_in_horovods_slot,
    _check_integer_average_scales_the_sum_once_by_postscale_over_size,
    _check_alltoall_async_synchronizes_to_output_and_received_splits,
    _check_failed_collectives_raise_horovod_internal_error,
    _check_complex_reduces_and_wrong_dtypes_are_refused_on_every_rank,
    _check_objects_travel_by_cloudpickle_and_a_failure_raises_on_every_rank,
]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_collectives_match_horovod_in_signatures_scaling_errors_and_dtypes(no_leftover_processes):
    _in_world_of_two("signatures")


# ====================================================================== broadcast_optimizer_state


def _optimizer_classes() -> List[type]:
    # SparseAdam needs sparse gradients; every other torch.optim optimizer is covered.
    return [cls for name, cls in sorted(vars(torch.optim).items())
            if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)
            and cls not in (torch.optim.Optimizer, torch.optim.SparseAdam)]


def _local_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, data_rank: int = -1) -> None:
    """Plain optimizer steps on rank ``data_rank``'s data (default: this rank's own)."""
    for step in range(steps):
        batch = _batch(hvd.rank() if data_rank < 0 else data_rank, step)

        def closure() -> Tensor:
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            return loss

        opt.step(closure)


def _check_broadcast_state_of_every_optimizer() -> None:
    r = hvd.rank()
    for cls in _optimizer_classes():
        model = _mlp()
        # Muon updates matrices only; the biases stay where they are.
        params = [p for p in model.parameters() if cls is not torch.optim.Muon or p.dim() == 2]
        opt = cls(params, lr=0.01 * (r + 1))
        _local_steps(model, opt, steps=r + 2)  # a different number of steps, so different state
        hvd.broadcast_parameters(model.state_dict(), root_rank=1)
        own_state, params = _digest(opt.state_dict()), _params_digest(model)

        hvd.broadcast_optimizer_state(opt, root_rank=1)

        assert _params_digest(model) == params, f"{cls.__name__}: parameters moved"
        if r == 1:
            assert _digest(opt.state_dict()) == own_state, f"{cls.__name__}: the root's state changed"
        assert _same_on_all_ranks(_digest(opt.state_dict())), f"{cls.__name__}: states differ"
        assert opt.param_groups[0]["lr"] == 0.02, cls.__name__
        # With the same state and the same data, the next steps stay identical on every rank.
        _local_steps(model, opt, steps=2, data_rank=0)
        assert _same_on_all_ranks(_params_digest(model)), f"{cls.__name__}: ranks diverged after the broadcast"


def _check_broadcast_state_does_not_step() -> None:
    # Horovod creates missing state with a zero-gradient step, which moves Adam's parameters
    # (weight decay) and moments; here a fresh optimizer stays fresh and nothing moves.
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    if hvd.rank() == 1:
        _local_steps(model, opt, steps=1)  # only the non-root has state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    params = _params_digest(model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert _params_digest(model) == params
    assert opt.state_dict()["state"] == {}
    if hvd.rank() == 0:  # as after Horovod's step, a fresh optimizer's parameters have (zero) gradients
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def _check_resume_on_root_then_broadcast() -> None:
    # Horovod's checkpoint pattern: only rank 0 loads, then parameters and state are broadcast.
    trained = _mlp(seed=3)
    trained_opt = torch.optim.Adam(trained.parameters(), lr=0.01)
    _local_steps(trained, trained_opt, steps=3)
    checkpoint = hvd.broadcast_object({"model": trained.state_dict(), "optimizer": trained_opt.state_dict()}, 0)

    model = _mlp(seed=hvd.rank())
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    if hvd.rank() == 0:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert _digest(opt.state_dict()) == _digest(checkpoint["optimizer"])
    for step in range(2):
        opt.zero_grad()
        _loss(model, _batch(hvd.rank(), step)).backward()
        opt.step()
    assert _same_on_all_ranks(_params_digest(model))
    opt.close()


def _check_model_makes_the_zero_gradients_of_sparse_embeddings_sparse() -> None:
    # Horovod's model= tells which parameters are sparse embeddings: their zero gradients are sparse, as
    # backward makes them, so the next backward adds to them sparsely.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    rows, head = model[0].weight, model[1].weight
    assert rows.grad.is_sparse and rows.grad.sparse_dim() == 1 and not rows.grad.to_dense().any()
    assert not head.grad.is_sparse and not head.grad.any()
    model(torch.tensor([hvd.rank()])).sum().backward()
    assert rows.grad.is_sparse
    opt.step()
    # SparseAdam takes sparse gradients only: all of its zero gradients are sparse, with or without model.
    embedding = nn.Embedding(10, 3, sparse=True)
    sparse_adam = torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1)
    hvd.broadcast_optimizer_state(sparse_adam, 1)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    sparse_adam.step()
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module \(to find its sparse embeddings\) or "
                                        r"None, got list"):
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=[model])


BROADCAST_OPTIMIZER_STATE = [
    _check_broadcast_state_of_every_optimizer,
    _check_broadcast_state_does_not_step,
    _check_resume_on_root_then_broadcast,
    _check_model_makes_the_zero_gradients_of_sparse_embeddings_sparse,
]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_broadcast_optimizer_state(no_leftover_processes):
    _in_world_of_two("broadcast_optimizer_state")


# ====================================================================== DistributedOptimizer


def _wrap(model: nn.Module, lr: float = 0.1, **kwargs: Any) -> hvd.DistributedOptimizer:
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                    named_parameters=model.named_parameters(), **kwargs)


def _check_average_sum_and_predivide() -> None:
    n = hvd.size()
    everyone = [_batch(r) for r in range(n)]
    for op, factor, scale in ((hvd.Average, 1.0, 1.0 / n), (hvd.Sum, 1.0, 1.0), (hvd.Average, 4.0, 1.0 / n)):
        model = _mlp()
        expected = [sum(g) * scale for g in zip(*[_grads(model, [b]) for b in everyone])]
        opt = _wrap(model, op=op, gradient_predivide_factor=factor)
        _loss(model, everyone[hvd.rank()]).backward()
        assert _close([p.grad for p in model.parameters()], expected), (op, factor)
        opt.step()
        assert _same_on_all_ranks(_params_digest(model))
        opt.close()


def _check_ranks_with_different_gradients() -> None:
    # Each rank uses a different head; a third head is used by no rank. Nothing hangs.
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(4, 4).double()
            self.heads = nn.ModuleList([nn.Linear(4, 1).double() for _ in range(3)])

        def forward(self, x: Tensor, head: int) -> Tensor:
            return self.heads[head](torch.tanh(self.body(x)))

    model = TwoHeads()
    opt = _wrap(model)
    unused = [p.clone() for p in model.heads[2].parameters()]
    for step in range(3):
        opt.zero_grad()
        model(_batch(hvd.rank(), step)[0], head=hvd.rank()).pow(2).mean().backward()
        opt.step()
        assert all(p.grad is None for p in model.heads[2].parameters())
    assert _close(list(model.heads[2].parameters()), unused, tol=0)
    assert _same_on_all_ranks(_params_digest(model))
    opt.close()


def _check_clipping_after_synchronize() -> None:
    model = _mlp()
    opt = _wrap(model, lr=0.5)
    _loss(model, _batch(hvd.rank())).backward()
    opt.synchronize()
    prior = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.clone() for p in model.parameters()]
    assert torch.cat([g.flatten() for g in clipped]).norm() < prior.norm()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    # The step applied the averaged gradients as clipped.
    assert _close([p.detach() for p in model.parameters()], [b - 0.5 * g for b, g in zip(before, clipped)])
    assert _same_on_all_ranks(_params_digest(model))
    opt.close()


def _check_step_after_synchronize_warns() -> None:
    model = _mlp()
    opt = _wrap(model)
    for synchronize_first in (True, False):
        opt.zero_grad()
        _loss(model, _batch(hvd.rank())).backward()
        if synchronize_first:
            opt.synchronize()
            for p in model.parameters():
                p.grad.fill_(hvd.rank() + 1.0)  # differs between ranks: a second reduction would show
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        messages = [str(w.message) for w in caught]
        assert (len(messages) == 1 and "skip_synchronize()" in messages[0]) == synchronize_first, messages
        if synchronize_first:
            assert caught[0].filename == __file__  # points at the caller's step()
            assert all(bool((p.grad == hvd.rank() + 1.0).all()) for p in model.parameters())  # not reduced again
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert _same_on_all_ranks(_params_digest(model))
    opt.close()


def _check_backward_passes_per_step() -> None:
    n, r = hvd.size(), hvd.rank()
    model = _mlp()
    opt = _wrap(model, backward_passes_per_step=3)
    assert opt.backward_passes_per_step == 3
    for passes in (3, 2):  # 2 < 3: step() reduces what was accumulated
        opt.zero_grad()
        expected = [sum(g) / n for g in zip(*[_grads(model, [_batch(q, s) for s in range(passes)], 1 / passes)
                                             for q in range(n)])]
        for s in range(passes):
            (_loss(model, _batch(r, s)) / passes).backward()
        if passes == 2:
            opt.synchronize()  # the AMP pattern: force the reduction, then unscale/clip
        assert _close([p.grad for p in model.parameters()], expected), passes
        with opt.skip_synchronize():
            opt.step()
    opt.set_backward_passes_per_step(2)
    assert opt.backward_passes_per_step == 2
    opt.zero_grad()
    for s in range(2):
        _loss(model, _batch(r, s)).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        _loss(model, _batch(r, 2)).backward()  # a third pass: Horovod's misuse, a RuntimeError here
    opt.zero_grad(set_to_none=False)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
    _loss(model, _batch(r)).backward()
    _loss(model, _batch(r, 1)).backward()
    opt.step()
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
        opt.set_backward_passes_per_step(0)
    assert _same_on_all_ranks(_params_digest(model))
    opt.close()


def _check_zero_grad_right_after_backward() -> None:
    # Horovod raises here ("prohibited as it can cause a race condition"); distopt waits instead.
    model = _mlp()
    opt = _wrap(model)
    _loss(model, _batch(hvd.rank())).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    _loss(model, _batch(hvd.rank(), 1)).backward()
    opt.step()
    assert _same_on_all_ranks(_params_digest(model))
    opt.close()


def _check_mixed_precision_with_grad_scaler() -> None:
    # Horovod's AMP pattern, on CPU: bfloat16 autocast and torch.amp.GradScaler.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(32, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        # On step 5 one rank overflows: the averaged gradients are inf on every rank, so every
        # rank's scaler skips the same step and the ranks stay in lockstep.
        scaled = scaler.scale(loss) * (math.inf if step == 5 and hvd.rank() == 1 else 1.0)
        scaled.backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert scaler.get_scale() < 2.0**10  # the overflow was seen
    assert _same_on_all_ranks(_params_digest(model))
    assert losses[-1] < 0.5 * losses[0], losses
    opt.close()


def _check_sparse_gradients_come_back_sparse() -> None:
    # As with Horovod, whatever sparse_as_dense says: the step sees the averaged gradient, sparse.
    expected = torch.zeros(10, 3)
    expected[[0, 1]] = 0.5  # each row used on one rank of two
    expected[5] = 1.0  # used on both
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 3, sparse=True)
        reference = nn.Embedding(10, 3, sparse=True)
        reference.load_state_dict(embedding.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                       sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SparseAdam(list(reference.parameters()), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            embedding(torch.tensor([hvd.rank(), 5])).sum().backward()
            if step == 0:  # Horovod's explicit protocol; later steps let step() reduce
                opt.synchronize()
                grad = embedding.weight.grad
                assert grad.is_sparse and grad.sparse_dim() == 1 and torch.equal(grad.to_dense(), expected)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            reference.weight.grad = expected.to_sparse(1)
            ref_opt.step()
        assert torch.equal(embedding.weight, reference.weight), sparse_as_dense
        opt.close()
    # Beside dense parameters: only the sparse one keeps its watch after the first step.
    embedding, head = nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*embedding.parameters(), *head.parameters()], lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        head(embedding(torch.tensor([hvd.rank(), 5]))).sum().backward()
        opt.step()
        assert embedding.weight.grad.is_sparse and not head.weight.grad.is_sparse
        assert list(opt._sparse_hooks) == [embedding.weight]
    opt.close()


# ====================================================================== wire compression (in the same world)


def _regression_data(rank: int) -> tuple:
    g = torch.Generator().manual_seed(rank)
    true_w = torch.linspace(-2, 2, 16).view(16, 1)
    x = torch.randn(64, 16, generator=g)
    return x, x @ true_w + 0.01 * torch.randn(64, 1, generator=g), true_w.view(-1)


def _regression(compression: Any, steps: int) -> tuple:
    """Least squares on this rank's shard, data-parallel; returns (first loss, last loss, weights)."""
    x, y, _ = _regression_data(hvd.rank())
    torch.manual_seed(0)
    model = nn.Linear(16, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=compression)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt.close()
    return losses[0], losses[-1], model.weight.detach().clone().view(-1)


def _regression_reference(steps: int) -> torch.Tensor:
    """The same training in one process, in float64, on the mean of both ranks' gradients."""
    shards = [_regression_data(r) for r in range(2)]
    torch.manual_seed(0)
    w = nn.Linear(16, 1, bias=False).weight.detach().double().clone().requires_grad_()
    for _ in range(steps):
        loss = sum(F.mse_loss(x.double() @ w.t(), y.double()) for x, y, _ in shards) / 2
        (grad,) = torch.autograd.grad(loss, w)
        with torch.no_grad():
            w -= 0.1 * grad
    return w.detach().view(-1)


def _check_compressed_training_converges() -> None:
    # After 5 steps the trajectory still shows whether the ranks averaged (not summed, not
    # skipped); after 80 the weights have converged to the least-squares solution.
    # Against the float64 reference: uncompressed float32 training differs by a few float32 ulps; a
    # 16-bit wire rounds each step's mean gradient to 11 (fp16) or 8 (bf16) significant bits, which
    # after 5 steps shows at about 2e-4 and 2e-3 (measured); by 80 steps the gradients, and with them
    # the rounding, have shrunk towards the least-squares solution, which all reach within float32's noise.
    tolerances = {(5, "NoneCompressor"): 1e-6, (5, "FP16Compressor"): 1e-3, (5, "BF16Compressor"): 1e-2,
                  (80, "NoneCompressor"): 1e-5, (80, "FP16Compressor"): 1e-5, (80, "BF16Compressor"): 1e-5}
    true_w = _regression_data(0)[2]
    for steps in (5, 80):
        reference = _regression_reference(steps).float()
        for compression in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16):
            first, last, weights = _regression(compression, steps)
            assert _same_on_all_ranks(weights.tolist()), compression.__name__  # compressed all-reduce ran
            tolerance = tolerances[steps, compression.__name__]
            assert torch.allclose(weights, reference, rtol=0, atol=tolerance), (
                compression.__name__, steps, weights - reference)
            if steps == 80:  # every compression converges, to the least-squares solution
                assert last < 1e-3 * first, (compression.__name__, first, last)
                assert torch.allclose(weights, true_w, atol=3e-2), (compression.__name__, weights - true_w)


def _check_fp16_gradients_do_not_overflow() -> None:
    # Gradients of 40000 on each rank sum to 80000 > float16's 65504.
    model = nn.Linear(8, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compression=hvd.Compression.fp16)
    (model(torch.full((1, 8), 40000.0 + 16 * hvd.rank())).sum()).backward()
    assert torch.isfinite(model.weight.grad).all()
    assert torch.allclose(model.weight.grad, torch.full((1, 8), 40008.0), rtol=1e-3)
    assert opt.compression == "fp16"
    opt.close()



DISTRIBUTED_OPTIMIZER = [
    _check_average_sum_and_predivide,
    _check_ranks_with_different_gradients,
    _check_clipping_after_synchronize,
    _check_step_after_synchronize_warns,
    _check_backward_passes_per_step,
    _check_zero_grad_right_after_backward,
    _check_mixed_precision_with_grad_scaler,
    _check_sparse_gradients_come_back_sparse,
    _check_compressed_training_converges,
    _check_fp16_gradients_do_not_overflow,
]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_distributed_optimizer_semantics_and_wire_compression(no_leftover_processes):
    _in_world_of_two("distributed_optimizer")


# The groups of checks above, by name, each run by _in_world_of_two in one launch that they share.
WORLD = Worlds({name: (2, _run_checks, (checks,)) for name, checks in [
    ("collectives", COLLECTIVES), ("signatures", SIGNATURES), ("broadcast_optimizer_state", BROADCAST_OPTIMIZER_STATE),
    ("distributed_optimizer", DISTRIBUTED_OPTIMIZER)]}, timeout=WORLD_TIMEOUT)


# ====================================================================== one process, no spawning


@pytest.fixture
def job_of_one(monkeypatch):
    """``hvd.init()`` in this process, started without torchrun: a job of one process."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    hvd.init()
    yield
    hvd.shutdown()


def test_not_initialized_is_horovods_value_error():
    hvd.shutdown()
    assert not hvd.is_initialized()
    for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
                 lambda: hvd.allreduce(torch.ones(1)),
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))):
        with pytest.raises(ValueError, match=re.escape("Horovod has not been initialized; use hvd.init().")):
            call()


def test_plain_python_runs_a_job_of_one(job_of_one):
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size()) == (1, 0, 1, 0, 1)
    t = torch.arange(3.0)
    assert torch.equal(hvd.allreduce(t), t) and torch.equal(hvd.allgather(t), t) and hvd.allgather(t) is not t
    assert torch.equal(hvd.broadcast(t, 0), t)
    assert hvd.broadcast_object("x") == "x" and hvd.allgather_object(1) == [1] and hvd.join() == 0
    # The optimizer is bitwise the inner optimizer.
    models = [_mlp(), _mlp()]
    plain = torch.optim.Adam(models[0].parameters(), lr=0.01)
    wrapped = hvd.DistributedOptimizer(torch.optim.Adam(models[1].parameters(), lr=0.01),
                                       named_parameters=models[1].named_parameters())
    for step in range(3):
        for model, opt in zip(models, (plain, wrapped)):
            opt.zero_grad()
            _loss(model, _batch(0, step)).backward()
            opt.step()
    assert _params_digest(models[0]) == _params_digest(models[1])
    schedule = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    wrapped.step()
    schedule.step()
    assert wrapped.param_groups[0]["lr"] == 0.005 and wrapped.optimizer.param_groups[0]["lr"] == 0.005
    hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    hvd.broadcast_parameters(models[1].state_dict(), root_rank=0)
    wrapped.close()


def test_init_sets_horovodruns_variables_for_scripts_that_read_them_and_shutdown_removes_them(job_of_one):
    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
             "HOROVOD_CROSS_SIZE")
    # Horovod's test_horovod_rank and test_horovod_size, after hvd.init():
    assert int(os.getenv("HOROVOD_RANK", -1)) == hvd.rank() and int(os.getenv("HOROVOD_SIZE", -1)) == hvd.size()
    assert [os.environ[name] for name in names] == ["0", "1", "0", "1", "0", "1"]
    hvd.shutdown()
    assert [name for name in names if name in os.environ] == []
    hvd.init()
    assert os.environ["HOROVOD_RANK"] == "0"


def test_named_parameters_errors_use_horovods_wording(job_of_one):
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    cases = [
        ([named[0], named[1], ("0.weight", named[2][1]), named[3]],
         "Parameter names in named_parameters must be unique. Found duplicates: 0.weight"),
        (named[1:], r"named_parameters was specified, but one or more model parameters were not named: "
                    r"param_groups\[0\]\['params'\]\[0\] \(shape \[8, 4\]\)"),
        ([p for _, p in named], r"named_parameters should be a sequence of tuples \(name, parameter\)"),
    ]
    for named_parameters, message in cases:
        with pytest.raises(ValueError, match=message):
            hvd.DistributedOptimizer(sgd, named_parameters=named_parameters)
    # One tensor under two names (tied weights) is fine, as with Horovod.
    opt = hvd.DistributedOptimizer(sgd, named_parameters=named + [("tied", named[0][1])])
    opt.close()
    # Horovod's private map, which users' code reads: parameter -> name, given or by position.
    opt = hvd.DistributedOptimizer(sgd, named_parameters=named)
    assert opt._parameter_names == {p: name for name, p in named}
    opt.close()
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[2].parameters()}], lr=0.1))
    assert list(opt._parameter_names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                                   "allreduce.noname.1.0", "allreduce.noname.1.1"]
    opt.close()


def test_misuse_and_unsupported_features_say_what_to_do(job_of_one):
    sgd = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    cases = [
        (lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum), NotImplementedError, "op=hvd.Average"),
        (lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum), NotImplementedError, "Adasum is not supported"),
        (lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0), ValueError,
         "gradient_predivide_factor not supported with op != Average"),
        (lambda: hvd.DistributedOptimizer(sgd, op=hvd.Max), ValueError, "hvd.Average or hvd.Sum"),
        (lambda: hvd.DistributedOptimizer(sgd, compression="zip"), TypeError, "hvd.Compression.fp16"),
        (lambda: hvd.DistributedOptimizer(sgd, compression=type("Mine", (hvd.Compressor,), {})), TypeError,
         "Mine is not supported"),
        (lambda: hvd.DistributedOptimizer(sgd, groups="x"), ValueError, "groups should be a non-negative integer"),
        (lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=0), ValueError, "backward_passes_per_step"),
        (lambda: hvd.DistributedOptimizer(nn.Linear(1, 1)), TypeError, "torch.optim.Optimizer"),
        (lambda: hvd.allreduce(torch.ones(1), op="median"), ValueError, "op must be one of"),
        (lambda: hvd.allreduce(torch.ones(1), process_set=object()), TypeError, "must be a ProcessSet"),
        (lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0])), ValueError, "was not added"),
        (lambda: hvd.ProcessSet("01"), TypeError, r"list of ranks \(ints\)"),
        (lambda: hvd.add_process_set([0, 1]), ValueError, r"ranks in 0..0, got \[0, 1\]"),
        (lambda: hvd.init(comm=[0]), NotImplementedError, "torchrun"),
        (lambda: hvd.broadcast_optimizer_state(nn.Linear(1, 1), 0), TypeError, "torch.optim.Optimizer"),
        (lambda: hvd.broadcast_optimizer_state(sgd, 0, model="net"), TypeError, "model must be a torch.nn.Module"),
        (lambda: hvd.allreduce(torch.tensor([1j]), op=hvd.Min), ValueError, "op=hvd.Min is not supported for complex"),
        (lambda: hvd.reducescatter(torch.tensor([True]), op=hvd.Sum), ValueError, "not supported for bool tensors"),
        (lambda: hvd.sparse_allreduce_async(torch.ones(2)), TypeError, "sparse COO tensor"),
        (lambda: hvd.SyncBatchNorm, AttributeError, "convert_sync_batchnorm"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert not hasattr(hvd, "elastic")
    with pytest.warns(DeprecationWarning, match="num_groups"):
        hvd.DistributedOptimizer(sgd, num_groups=2, groups=[[]]).close()


def test_horovods_names_and_defaults():
    expected = {
        "DistributedOptimizer": "(optimizer, named_parameters=None, compression=<NoneCompressor>, "
                                "backward_passes_per_step=1, op=<Average>, gradient_predivide_factor=1.0, "
                                "num_groups=0, groups=None, sparse_as_dense=False, process_set=<global>)",
        "allreduce": "(tensor, average=None, name=None, compression=<NoneCompressor>, op=None, "
                     "prescale_factor=1.0, postscale_factor=1.0, process_set=<global>)",
        "allreduce_": "(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                      "process_set=<global>)",
        "allreduce_async_": "(tensor, average=None, name=None, op=None, prescale_factor=1.0, "
                            "postscale_factor=1.0, process_set=<global>)",
        "allgather": "(tensor, name=None, process_set=<global>)",
        "broadcast": "(tensor, root_rank, name=None, process_set=<global>)",
        "broadcast_": "(tensor, root_rank, name=None, process_set=<global>)",
        "broadcast_parameters": "(params, root_rank)",
        "broadcast_optimizer_state": "(optimizer, root_rank, model=None)",
        "reducescatter": "(tensor, name=None, compression=<NoneCompressor>, op=<Average>, process_set=<global>, "
                         "prescale_factor=1.0, postscale_factor=1.0)",
        "grouped_reducescatter": "(tensors, name=None, compression=<NoneCompressor>, op=<Average>, "
                                 "process_set=<global>, prescale_factor=1.0, postscale_factor=1.0)",
        "reducescatter_async": "(tensor, name=None, op=<Average>, process_set=<global>, prescale_factor=1.0, "
                               "postscale_factor=1.0)",
        "alltoall_async": "(tensor, splits=None, name=None, process_set=<global>)",
        "broadcast_object": "(obj, root_rank=0, name=None, process_set=<global>)",
        "allgather_object": "(obj, name=None, process_set=<global>)",
        "init": "(comm=None, process_sets=None)",
        "join": "(device=-1)",
        "synchronize": "(handle)",
        "poll": "(handle)",
    }

    def show(value: Any) -> str:
        if value is hvd.global_process_set:
            return "<global>"
        if value is hvd.Average:
            return "<Average>"
        if inspect.isclass(value):
            return f"<{value.__name__}>"
        return repr(value)

    for name, signature in expected.items():
        params = inspect.signature(getattr(hvd, name)).parameters.values()
        shown = ", ".join(p.name if p.default is p.empty else f"{p.name}={show(p.default)}" for p in params)
        assert f"({shown})" == signature, name
    assert (int(hvd.Average), int(hvd.Sum), int(hvd.Adasum)) == (0, 1, 2)
    for name in ("init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_rank",
                 "cross_size", "skip_synchronize", "set_backward_passes_per_step", "Min", "Max", "allreduce_async",
                 "allgather_async", "broadcast_async", "broadcast_async_", "barrier"):
        assert hasattr(hvd, name) or hasattr(hvd.DistributedOptimizer, name), name
    assert set(hvd.__all__) <= set(dir(hvd))


def test_the_package_exports_its_modules_public_names_and_nothing_else():
    """``hvd.__all__`` is the union of the modules' ``__all__``, each name defined once, nothing leaked."""
    modules = [importlib.import_module(f"{hvd.__name__}.{info.name}") for info in pkgutil.iter_modules(hvd.__path__)]
    names = [name for module in modules for name in module.__all__]
    assert len(names) == len(set(names)), "a public name is defined by two modules"
    assert sorted(hvd.__all__) == sorted(names)
    for module in modules:
        for name in module.__all__:
            assert getattr(hvd, name) is getattr(module, name), name
    submodules = {module.__name__.rpartition(".")[2] for module in modules}
    assert {name for name in dir(hvd) if not name.startswith("_")} == set(hvd.__all__) | submodules


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-6e4, 6e4, allow_nan=False, width=32), min_size=1, max_size=64),
       st.sampled_from([torch.float32, torch.float64]))
def test_fp16_compression_round_trip(values, dtype):
    # Horovod's test_compression_fp16: floats travel as float16 and come back in their own dtype.
    tensor = torch.tensor(values, dtype=dtype)
    compressed, ctx = hvd.Compression.fp16.compress(tensor)
    assert compressed.dtype == torch.float16
    restored = hvd.Compression.fp16.decompress(compressed, ctx)
    assert restored.dtype == dtype
    assert torch.allclose(restored, tensor, rtol=2**-10, atol=2**-14)


def test_compression_leaves_integers_alone():
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16, hvd.Compression.none):
        for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
            tensor = torch.ones(5, 5, 5, dtype=dtype)
            compressed, ctx = compression.compress(tensor)
            assert compressed.dtype == dtype
            restored = compression.decompress(compressed, ctx)
            assert restored.dtype == dtype and torch.equal(restored, tensor)
        ones = torch.ones(5, 5, 5)
        assert torch.equal(compression.decompress(*compression.compress(ones)), ones)


# ====================================================================== Horovod scripts under torchrun


def test_scripts_are_horovod_code_but_for_the_import():
    """Replacing the one ``import distopt.horovod as hvd`` line gives back a Horovod script."""
    for script in HOROVOD_SCRIPTS:
        uses = [node for node in ast.walk(ast.parse(script.read_text())) if _mentions_distopt(node)]
        assert len(uses) == 1, f"{script.name}: {[ast.unparse(u) for u in uses]}"
        assert ast.unparse(uses[0]) == "import distopt.horovod as hvd", script.name


def _mentions_distopt(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "distopt" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "distopt"
    return isinstance(node, ast.Name) and node.id == "distopt"


def _write_epoch_one_checkpoint(path: Path) -> Dict[str, Any]:
    """A checkpoint as hvd_accumulate.py saves it after epoch 1: its model and SGD momentum."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9, weight_decay=0.00005)
    F.cross_entropy(model(torch.rand(8, 64)), torch.arange(8)).backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(state, path)
    return state


GPUS = torch.cuda.device_count() >= 2  # one GPU per rank, as Horovod's scripts set them; else --no-cuda


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory) -> Dict[str, tuple]:
    """The Horovod scripts under torchrun with 2 processes, side by side (most of each is process start-up):
    name -> ``(its directory, script, exit code or None on a timeout, output)``. Each tree is killed on a timeout."""
    no_cuda = [] if GPUS else ["--no-cuda"]
    jobs = {
        "migration": (EXAMPLE, ["--epochs", "2", "--use-mixed-precision", "--fp16-allreduce",
                                "--gradient-predivide-factor", "2", *no_cuda]),
        "synthetic benchmark": (SCRIPTS / "hvd_synthetic_benchmark.py",
                                ["--batch-size", "8", "--num-warmup-batches", "2", "--num-batches-per-iter", "2",
                                 "--num-iters", "3", "--fp16-allreduce", *no_cuda]),
        "init again": (SCRIPTS / "hvd_init_again.py", []),
        "accumulate": (SCRIPTS / "hvd_accumulate.py", ["--batches-per-allreduce", "4", "--epochs", "2"]),
    }
    dirs = {name: tmp_path_factory.mktemp(name.replace(" ", "-")) for name in jobs}
    # hvd_accumulate.py resumes from the checkpoint it would have saved after epoch 1.
    _write_epoch_one_checkpoint(dirs["accumulate"] / "checkpoint-1.pth.tar")
    jobs["accumulate"][1].extend(["--checkpoint-format", str(dirs["accumulate"] / "checkpoint-{epoch}.pth.tar")])
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(run_torchrun, script, args, dirs[name], TORCHRUN_TIMEOUT)
                   for name, (script, args) in jobs.items()}
        return {name: (dirs[name], jobs[name][0], *future.result()) for name, future in futures.items()}


def _torchrun(job: tuple) -> str:
    """The output of one of ``torchrun_jobs``, which must have ended with status 0."""
    _, script, code, out = job
    if code is None:
        pytest.fail(f"{script.name} did not finish in {TORCHRUN_TIMEOUT} s:\n{out}")
    assert code == 0, f"{script.name} exited with {code}:\n{out}"
    return out


@pytest.mark.timeout(TORCHRUN_TIMEOUT + 30)
def test_migration_example_with_mixed_precision_and_fp16_allreduce(torchrun_jobs, no_leftover_processes):
    out = _torchrun(torchrun_jobs["migration"])  # 2 epochs, --use-mixed-precision --fp16-allreduce, predivide 2
    accuracies = [float(a) for a in re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", out)]
    assert len(accuracies) == 2, out
    assert accuracies[-1] > 60.0, out  # 10 classes: chance is 10%
    assert "parameters identical on all 2 rank(s)" in out, out


@pytest.mark.timeout(TORCHRUN_TIMEOUT + 30)
def test_synthetic_benchmark_prints_images_per_second(torchrun_jobs, no_leftover_processes):
    device = "GPU" if GPUS else "CPU"
    out = _torchrun(torchrun_jobs["synthetic benchmark"])  # 3 iterations, --fp16-allreduce
    assert f"Number of {device}s: 2" in out, out
    assert len(re.findall(rf"^Iter #\d: [\d.]+ img/sec per {device}$", out, re.MULTILINE)) == 3, out
    total = re.search(rf"^Total img/sec on 2 {device}\(s\): ([\d.]+) \+-[\d.]+$", out, re.MULTILINE)
    assert total is not None and float(total.group(1)) > 0, out
    assert "RuntimeWarning" not in out, out  # no hvd.shutdown(), as in Horovod's script, and a quiet exit


@pytest.mark.timeout(TORCHRUN_TIMEOUT + 30)
def test_under_torchrun_init_sets_horovodruns_variables_and_join_skips_an_earlier_sessions_optimizer(
        torchrun_jobs, no_leftover_processes):
    out = _torchrun(torchrun_jobs["init again"])
    for rank in (0, 1):
        # What horovodrun sets: rank, size, local rank, local size, cross rank, cross size.
        for session in (1, 2):
            assert f"RANK {rank} SESSION {session} ENV {rank} 2 {rank} 2 0 1" in out, out
        assert f"RANK {rank} SESSION closed ENV - - - - - -" in out, out
        # The optimizer built before hvd.shutdown() lost its group with the session; the join leaves it out.
        assert f"RANK {rank} JOINED last=1 identical=True" in out, out


@pytest.mark.timeout(TORCHRUN_TIMEOUT + 30)
def test_gradient_accumulation_resuming_from_a_checkpoint(torchrun_jobs, no_leftover_processes):
    # --batches-per-allreduce 4 --epochs 2, from the checkpoint of epoch 1 in its directory
    tmp_path = torchrun_jobs["accumulate"][0]
    out = _torchrun(torchrun_jobs["accumulate"])
    # Rank 0 loaded the checkpoint; parameters and momentum were broadcast to rank 1.
    assert "resuming from epoch 1" in out and "epoch 1 " not in out, out
    # 719 samples per rank in batches of 4 x 16: 12 steps, the last of 15 samples, so one sub-batch of 4:
    # step() reduces what one backward accumulated (the ranks stay identical, checked below).
    assert re.search(r"^epoch 2 steps 12 \(the last with 1 of 4 sub-batches\) train loss", out, re.MULTILINE), out
    accuracy = float(re.search(r"^epoch 2 val loss [\d.]+ val accuracy ([\d.]+)$", out, re.MULTILINE).group(1))
    assert accuracy > 0.3, out  # one epoch from a near-random start; chance is 0.1
    assert "parameters identical: True" in out, out
    assert (tmp_path / "checkpoint-2.pth.tar").exists()
    # Like Horovod's examples, the script never calls hvd.shutdown(): its exit is quiet, without a warning
    # about a group that something still references (the background thread held its last collective's).
    assert "RuntimeWarning" not in out, out
