"""Rank 1 leaves the training loop early; rank 0 reports what it was told.

Rank 1 returns (``finish``), raises (``crash``), all-reduces a metric (``metric``), or takes a snapshot
with ``state_dict()`` and ``shard_state=True`` alone and, as Hydra does with the error that follows,
prints it and exits with ``sys.exit(1)`` (``state_dict``).
Usage: torchrun --nproc-per-node 2 leave_early.py {finish,crash,metric,state_dict} {distopt,plain}
(``distopt``: the group from distopt.init(); ``plain``: from dist.init_process_group).
"""
import sys
import traceback

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
                                   stall_timeout=5 if how == "metric" else None,
                                   stall_warning=2 if how == "state_dict" else 60, shard_state=how == "state_dict")
x, y = torch.randn(6, 4), torch.randn(6, 2)
try:
    for step in range(4 if rank == 0 else 3):
        if rank == 1 and how == "state_dict" and step == 2:
            try:
                opt.state_dict()  # on this rank only: it waits for the others for stall_warning seconds
            except Exception:
                traceback.print_exc()
                sys.exit(1)
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
