"""Run under torchrun: hvd.init() sets horovodrun's variables; an optimizer of an earlier session is not joined.

Prints, per rank: ``RANK r SESSION k ENV ...`` (horovodrun's variables as a script reads them)
after each hvd.init() and after hvd.shutdown(), then ``RANK r JOINED last=L identical=B``.
Horovod code but for the import. hvd.init() creates the process group here, so hvd.shutdown()
destroys it, and with it the private group of the optimizer built before.
"""
import os

import torch
from torch import nn

import distopt.horovod as hvd

NAMES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
         "HOROVOD_CROSS_SIZE")


def show(session, rank):
    print(f"RANK {rank} SESSION {session} ENV " + " ".join(os.environ.get(name, "-") for name in NAMES), flush=True)


hvd.init()
rank = hvd.rank()
show(1, rank)
torch.manual_seed(0)
earlier = nn.Linear(3, 1)
earlier_opt = hvd.DistributedOptimizer(torch.optim.SGD(earlier.parameters(), lr=0.1))  # still referenced
hvd.shutdown()
show("closed", rank)
hvd.init()
show(2, rank)
model = nn.Linear(3, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(1 if rank == 0 else 3):  # uneven inputs
    opt.zero_grad()
    model(torch.full((2, 3), float(step))).sum().backward()
    opt.step()
last = hvd.join()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))
print(f"RANK {rank} JOINED last={last} identical={torch.equal(weights[0], weights[1])}", flush=True)
hvd.shutdown()
