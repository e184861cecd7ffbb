"""Peak allocator bytes per rank: FSDP2 alone vs FSDP2 inside Islands with each across mode (2 islands x 2 ranks).

8 layers of 2048 x 2048 float32 without bias, AdamW inside, 8 steps; glibc's mallinfo2 uordblks+hblkhd sampled
every 0.5 ms, peak over the bytes in use before the model was built."""
import ctypes
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt._testing import run_world


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def in_use():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def measure(kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    base = in_use()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    outer = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    if kind == "fsdp2":
        opt = inner
    else:
        across = {"sync": distopt.Synchronous(), "diloco": distopt.DiLoCo(4, outer),
                  "streaming": distopt.DiLoCo(4, outer, fragments=2)}[kind]
        opt = distopt.DistributedOptimizer(inner, mode=distopt.Islands(across=across, islands=mesh))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(8):
        x = torch.randn(4, 2048, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    stop.set()
    thread.join()
    params = [p.to_local().detach().clone() for p in model.parameters()]
    return (peak[0] - base) / 2 ** 20, [float(p.double().sum()) for p in params]


if __name__ == "__main__":
    for kind in sys.argv[1:]:
        out = run_world(measure, 4, kind, timeout=600)
        print(kind, "peak MiB per rank:", [round(mib, 1) for mib, _ in out], "checksum", out[0][1][:2], flush=True)
