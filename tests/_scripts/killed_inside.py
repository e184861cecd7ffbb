"""One rank is killed with SIGKILL inside backward or inside the sharded parameter exchange, at a given step.

Started by hand, one plain process per rank with env:// (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), with nothing that supervises. The kill comes right after the previous step, well
within the inspector's tick, so the killed rank's last published position is older than where it
was. The survivors print what they were told and exit with status 3, as a script that reports
its own error would. Usage: python killed_inside.py DEAD_RANK {backward,exchange} STEP
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import distopt

dead, where, kill_at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard_state=where == "exchange")
x, y = torch.randn(6, 4), torch.randn(6, 2)
step = 0


def die(*_):
    if rank == dead and step == kill_at:
        print(f"RANK{rank} KILLED AT {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if where == "backward":
    model[0].weight.register_hook(die)
else:
    from distopt.modes import sharded

    launch = sharded.launch_share

    def dying_launch(*args, **kwargs):  # where the updated parameters start on their way
        die()
        return launch(*args, **kwargs)

    sharded.launch_share = dying_launch
try:
    for step in range(kill_at + 2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
except RuntimeError as exc:
    print(f"RANK{rank} SAW AT {time.time()}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
