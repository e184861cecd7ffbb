"""GPU parameters: packs keyed by device, direct packs on CUDA tensors, NCCL.

Every test here needs a CUDA device and skips, saying so, without one. NCCL
needs one GPU per rank, so a machine with a single GPU runs NCCL at world size 1
and the two-rank checks over gloo, whose all-reduce and broadcast take CUDA
tensors; the two-rank NCCL test runs where two GPUs are visible. Each run trains
the same model as a single-process reference on the whole batch, in float64 so
that only summation order can differ, in every mode: the default plan (a 1 MiB
weight travels direct, the rest packed), everything in one pack, sharded
optimizer state, local SGD, and a model split between the CPU and the GPU.
Every compressor's codec also runs on CUDA tensors in a simulated world (no
processes), against the same codec on the CPU, and streaming DiLoCo with
compressed exchanges trains two ranks of a GPU model over gloo as it trains
them on the CPU.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedOptimizer
from distopt._testing import run_world
from distopt.compression import PowerSGD, Quantize, TopK

from distopt.compression.testing import layout_of, simulate

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


@needs_cuda
@pytest.mark.parametrize("make", [lambda: Quantize(bits=8), lambda: Quantize(bits=4), lambda: TopK(),
                                  lambda: PowerSGD(rank=2)], ids=["int8", "int4", "topk", "powersgd"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_codec_sums_cuda_tensors_alike_on_every_rank_and_like_on_the_cpu(make, world):
    results = {}
    for device in ("cpu", "cuda"):
        layout = layout_of([(96, 64), (64,), (33, 7)], device=device)
        gen = torch.Generator().manual_seed(world)
        compressors = [make() for _ in range(world)]
        codecs = [c.codec(layout) for c in compressors]
        for _ in range(3):  # three rounds, so that the residuals take part
            datas = [torch.randn(layout.numel, generator=gen).to(device) for _ in range(world)]
            simulate(codecs, datas)
            assert all(torch.equal(d, datas[0]) for d in datas), device
        results[device] = datas[0].cpu()
    # The same arithmetic on both, elementwise and in the same order; but where the devices' last bits
    # differ (a division, a fused multiply-add, PowerSGD's products) a value at a rounding boundary
    # takes the neighbouring code, and its residual differs from then on: a few values, not many.
    differ = ~torch.isclose(results["cuda"], results["cpu"], rtol=1e-4, atol=1e-5)
    assert differ.float().mean().item() <= 0.01, differ.sum().item()


def train_streaming(compression: str, device_type: str) -> dict:
    """Streaming DiLoCo with compressed exchanges on a model on ``device_type``: whether the last-sync
    copies are alike on every rank, the parameters it ends with, and how far they moved."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(rank)
    model = Net(device, device)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=4, sync_fragments=2,
                               sync_overlap=1, sync_mixing=0.5, compression=compression,
                               outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    start = [p.detach().cpu().clone() for p in model.parameters()]  # after the construction broadcast
    for step in range(12):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    anchors = [a.detach().cpu() for a in opt.state_dict()["distopt_local_sgd"]["anchors"] if a is not None]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, anchors)
    opt.close()
    params = [p.detach().cpu() for p in model.parameters()]
    return {"alike": all(torch.equal(a, b) for theirs in everyone for a, b in zip(theirs, anchors)),
            "params": params, "moved": max((a - b).norm().item() for a, b in zip(params, start))}


@needs_cuda
@pytest.mark.parametrize("compression", ["int4", "topk"])
def test_streaming_diloco_with_compressed_exchanges_trains_gpu_ranks_as_on_the_cpu(compression):
    gpu = run_world(train_streaming, 2, compression, "cuda", backend="gloo", timeout=240)
    cpu = run_world(train_streaming, 2, compression, "cpu", backend="gloo", timeout=240)
    for on_gpu, on_cpu in zip(gpu, cpu):
        assert on_gpu["alike"] and on_cpu["alike"]
        # The same run but for the devices' last bits (and a code or a choice they flip): a small part
        # of the way the parameters came.
        apart = max((a - b).norm().item() for a, b in zip(on_gpu["params"], on_cpu["params"]))
        assert apart < 0.05 * on_cpu["moved"], (apart, on_cpu["moved"])
