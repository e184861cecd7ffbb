"""One rank is killed with SIGKILL mid-training; the others report what they were told, and when.

Started by hand, one plain process per rank with env:// (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), as with no launcher that supervises: nothing stops the survivors, and rank 0
hosts the rendezvous store. Usage: python killed_peer.py DEAD_RANK
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import distopt

dead = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
x, y = torch.randn(6, 4), torch.randn(6, 2)
try:
    for step in range(6):
        opt.zero_grad()
        if rank == dead and step == 3:
            time.sleep(2.0)  # the inspector publishes where this rank is once a second
            print(f"RANK{rank} KILLED AT {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
except RuntimeError as exc:
    print(f"RANK{rank} SAW AT {time.time()}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
