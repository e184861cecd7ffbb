"""GPU parameters: packs keyed by device, direct packs on CUDA tensors, NCCL.

Every test here needs a CUDA device and skips, saying so, without one. NCCL
needs one GPU per rank, so a machine with a single GPU runs NCCL at world size 1
and the two-rank checks over gloo, whose all-reduce and broadcast take CUDA
tensors; the two-rank NCCL test runs where two GPUs are visible. Each run trains
the same model as a single-process reference on the whole batch, in float64 so
that only summation order can differ, in every mode: the default plan (a 1 MiB
weight travels direct, the rest packed), everything in one pack, sharded
optimizer state, local SGD, and a model split between the CPU and the GPU.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedOptimizer
from distopt._testing import run_world

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="NCCL needs one GPU per rank: two visible GPUs")

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_processes")]

BATCH = 8
STEPS = 4
TOL = 1e-10

MODES = {
    "default plan": {},
    "one pack": {"pack_threshold": 1 << 30},
    "shard_state": {"shard_state": True},
    "local SGD": {"sync_every": 2},
}


class Net(nn.Module):
    """A 1 MiB weight (a direct pack under the default plan) and small ones, on one device or split."""

    def __init__(self, device: torch.device, head_device: torch.device) -> None:
        super().__init__()
        self.big = nn.Linear(256, 512).to(device=device, dtype=torch.float64)  # 1 MiB of float64
        self.head = nn.Linear(512, 3).to(device=head_device, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.big(x.to(self.big.weight.device)))
        return self.head(h.to(self.head.weight.device))


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 256, generator=g, dtype=torch.float64), torch.randn(BATCH, 3, generator=g,
                                                                                    dtype=torch.float64)


def _train(model: Net, opt, rank: int, world: int) -> None:
    part = BATCH // world
    for step in range(STEPS):
        x, y = _data(step)
        x, y = x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y.to(model.head.weight.device)).backward()
        opt.step()


def _reference(world: int, device: torch.device, head_device: torch.device, sync_every: int):
    """Plain SGD on the whole batch (sync_every 1); for local SGD, each shard alone, averaged every k steps."""
    torch.manual_seed(0)
    models = [Net(device, head_device) for _ in range(world if sync_every > 1 else 1)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(STEPS):
        x, y = _data(step)
        for k, (m, o) in enumerate(zip(models, opts)):
            part = BATCH // len(models)
            xs, ys = x[k * part:(k + 1) * part], y[k * part:(k + 1) * part]
            o.zero_grad()
            nn.functional.mse_loss(m(xs), ys.to(head_device)).backward()
            o.step()
        if len(models) > 1 and (step + 1) % sync_every == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = sum(p for p in ps) / len(ps)
                    for p in ps:
                        p.copy_(mean)
    return [p.detach().cpu() for p in models[0].parameters()]  # identical replicas after the last average


def train_every_mode(head_on_cpu: bool = False):
    """On each rank: the largest parameter difference from the reference, and from rank 0, per mode."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    head_device = torch.device("cpu") if head_on_cpu else device
    results = {}
    for name, kwargs in MODES.items():
        torch.manual_seed(rank)  # different starts: the construction broadcast must align them
        model = Net(device, head_device)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kwargs)
        _train(model, opt, rank, world)
        mine = [p.detach().cpu() for p in model.parameters()]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        expected = _reference(world, device, head_device, kwargs.get("sync_every", 1))
        results[name] = {
            "from reference": max((a - b).abs().max().item() for a, b in zip(mine, expected)),
            "from rank 0": max((a - b).abs().max().item() for a, b in zip(mine, everyone[0])),
            "packs on": sorted({str(p.buffer.device) for p in opt._engine.packs}),
        }
        opt.close()
    return results


def _check(per_rank, devices):
    """Every rank equals rank 0 exactly and the reference to rounding; ``devices(rank)``: its packs' devices."""
    for rank, rank_results in enumerate(per_rank):
        assert set(rank_results) == set(MODES)
        for mode, got in rank_results.items():
            assert got["from rank 0"] == 0, (rank, mode, got)
            assert got["from reference"] < TOL, (rank, mode, got)
            assert got["packs on"] == devices(rank), (rank, mode, got)


@needs_cuda
def test_a_gpu_model_trains_like_single_process_over_nccl_at_world_size_one():
    # A world of one has nothing to average: the wrapper keeps no packs and steps like the bare optimizer.
    _check(run_world(train_every_mode, 1, backend="nccl", timeout=240), lambda rank: [])


@needs_cuda
def test_gpu_gradients_from_two_ranks_average_over_gloo():
    _check(run_world(train_every_mode, 2, backend="gloo", timeout=240), lambda rank: ["cuda:0"])


@needs_cuda
def test_a_model_split_between_cpu_and_gpu_gets_one_pack_per_device():
    _check(run_world(train_every_mode, 2, True, backend="gloo", timeout=240), lambda rank: ["cpu", "cuda:0"])


@needs_two_gpus
def test_two_ranks_on_two_gpus_train_like_single_process_over_nccl():
    _check(run_world(train_every_mode, 2, backend="nccl", timeout=240), lambda rank: [f"cuda:{rank}"])
