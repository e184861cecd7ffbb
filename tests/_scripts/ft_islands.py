"""One rank of an island under the fault-tolerant launcher, for tests/fault_tolerance/test_launch.py.

    python -m distopt.fault_tolerance.launch --replicas 2 --nproc-per-node 2 --max-restarts 1 \
        ft_islands.py OUT_DIR STEPS

Each replica is an island of ``--nproc-per-node`` ranks (one torchrun agent, its default group):
``mode=distopt.Islands()`` with ``fault_tolerance=make_manager()``, synchronous inside and across.
Each process appends JSON lines to ``OUT_DIR/island<R>-rank<J>-<pid>.jsonl``: who it is (pid,
torchrun's restart count), then one line per step (the committed step count, the islands in the
step, a hash of the parameters and Adam's state and one of the parameters alone, the time), then ``done``.
With a third argument ``diloco``, DiLoCo runs across (a sync every 4 steps; the islands' Adam states
differ between syncs, their parameters are alike right after each). The test kills one rank
of one island once both islands trained together, and writes ``OUT_DIR/killed`` just before. As
``ft_launched.py``: every rank trains until ``STEPS`` committed steps, and on until the killed
island is back and all trained together for 3 steps in a row (or for 80 s); all stop at the same step.
"""
import hashlib
import json
import os
import sys
import time

import torch

import distopt
from distopt.fault_tolerance.manager import make_manager

out_dir, steps = sys.argv[1], int(sys.argv[2])
island, islands = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
rank = int(os.environ["RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
out = open(os.path.join(out_dir, f"island{island}-rank{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
killed = os.path.join(out_dir, "killed")


def log(**fields):
    fields.setdefault("t", time.time())
    out.write(json.dumps(fields) + "\n")


def digest(model, opt=None):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in (opt.optimizer.state.values() if opt is not None else ()):
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().numpy().tobytes())
    return h.hexdigest()[:16]


log(pid=os.getpid(), restart=restart)
distopt.init(backend="gloo")  # the island: this agent's workers
manager = make_manager()
torch.manual_seed(1000 * island + rank)  # different inits: the island's root, then the first quorum, make them one
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
across = None
if len(sys.argv) > 3 and sys.argv[3] == "diloco":  # DiLoCo across: a quorum and a vote per sync, every 4 steps
    across = distopt.DiLoCo(every=4, outer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.5, nesterov=True))
opt = distopt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), pack_threshold=4096,
                                   mode=distopt.Islands(across=across), fault_tolerance=manager)
target = torch.randn(16, generator=torch.Generator().manual_seed(7))
streak, whole, back = 0, False, restart > 0
give_up = time.time() + 80  # the test's deadline is 90 s: a survivor waits this long for the killed island
try:
    while True:
        opt.zero_grad()
        g = torch.Generator().manual_seed(10_000 * manager.current_step() + 100 * island + rank)
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target).unsqueeze(1))
        loss.backward()
        opt.step()
        ft = opt.stats.fault_tolerance
        log(step=manager.current_step(), world=ft["world_size"], loss=loss.item(), digest=digest(model, opt),
            params=digest(model))
        time.sleep(0.02)  # a pace the test can kill into
        streak = streak + 1 if ft["world_size"] == islands else 0
        back = back or (whole and ft["world_size"] < islands and os.path.exists(killed))
        whole = whole or ft["world_size"] == islands
        if manager.current_step() >= steps and streak >= 3 and back:
            break
        if time.time() > give_up:
            log(gave_up=True)
            break
    record = opt.fault_tolerance.record
    log(done=True, step=manager.current_step(), heals=record.heals, committed=record.committed)
finally:
    manager.shutdown(wait=True)
    distopt.shutdown()
    out.close()
