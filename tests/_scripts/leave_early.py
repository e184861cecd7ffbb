"""Rank 1 leaves the training loop early; rank 0 reports what it was told.

Rank 1 returns (``finish``), raises (``crash``) or all-reduces a metric (``metric``).
Usage: torchrun --nproc-per-node 2 leave_early.py {finish,crash,metric} {distopt,plain}
(``distopt``: the group from distopt.init(); ``plain``: from dist.init_process_group).
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

import distopt

how, init = sys.argv[1], sys.argv[2]
if init == "distopt":
    distopt.init()
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   stall_timeout=5 if how == "metric" else None)
x, y = torch.randn(6, 4), torch.randn(6, 2)
try:
    for step in range(4 if rank == 0 else 3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if rank == 1 and how == "crash" and step == 2:
            raise ZeroDivisionError("a bad batch")
        opt.step()
    if how == "metric":
        dist.all_reduce(torch.ones(1))
except RuntimeError as exc:
    print(f"RANK{rank} SAW: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
