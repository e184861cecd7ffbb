"""One replica's worker under the fault-tolerant launcher, for tests/fault_tolerance/test_launch.py.

    python -m distopt.fault_tolerance.launch --replicas 3 --max-restarts 1 ft_launched.py OUT_DIR STEPS

``make_manager()`` takes everything from the launcher's environment, as a user's script does.
Each process appends JSON lines to ``OUT_DIR/replica<R>-<pid>.jsonl``: first who it is (pid,
torchrun's restart count, where distopt was imported from), then one line per step (the
committed step count, the world, the loss, a hash of the parameters and Adam's state), then
``done``. The test kills one replica once all have trained together, and writes
``OUT_DIR/killed`` just before. Every replica trains until ``STEPS`` committed steps, and on
until the killed one is back and all have trained together for 3 steps in a row: a survivor
knows it is back once it saw the world shrink after the kill (a replica dropped and back
before it, on a loaded host, does not count), the replacement by being a restart. All
replicas stop at the same step, since they see the same quorums; however late a replica
starts (on another host, say), no one stops before the kill.
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
replica, replicas = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
out = open(os.path.join(out_dir, f"replica{replica}-{os.getpid()}.jsonl"), "a", buffering=1)
killed = os.path.join(out_dir, "killed")  # the test writes it just before the kill


def log(**fields):
    fields.setdefault("t", time.time())
    out.write(json.dumps(fields) + "\n")


def digest(model, opt):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in opt.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().numpy().tobytes())
    return h.hexdigest()[:16]


log(pid=os.getpid(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), distopt=distopt.__file__)
manager = make_manager()
torch.manual_seed(1000 * replica)  # different inits: the first quorum heals them to one
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = distopt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), pack_threshold=4096,
                                   fault_tolerance=manager)
target = torch.randn(16, generator=torch.Generator().manual_seed(7))
streak = 0
whole = False  # all replicas trained together
back = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # the killed replica is back in
try:
    while True:
        opt.zero_grad()
        g = torch.Generator().manual_seed(10_000 * manager.current_step() + replica)
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target).unsqueeze(1))
        loss.backward()
        opt.step()
        ft = opt.stats.fault_tolerance
        log(step=manager.current_step(), world=ft["world_size"], loss=loss.item(), digest=digest(model, opt))
        time.sleep(0.02)  # a pace the test can kill into; a step alone takes a few ms
        streak = streak + 1 if ft["world_size"] == replicas else 0
        back = back or (whole and ft["world_size"] < replicas and os.path.exists(killed))
        whole = whole or ft["world_size"] == replicas
        if manager.current_step() >= steps and streak >= 3 and back:
            break
        if manager.current_step() >= 50 * steps:
            log(gave_up=True)
            break
    record = opt.fault_tolerance.record
    log(done=True, step=manager.current_step(), heals=record.heals, committed=record.committed)
finally:
    manager.shutdown(wait=True)  # torchft's threads, joined before the interpreter exits
    out.close()
