"""Fault-tolerant training on one machine: run it under the launcher,

    RUST_LOG=warn python -m distopt.fault_tolerance.launch --replicas 3 examples/train_ft.py --steps 300

and kill a worker (``pkill -9 -f train_ft.py`` kills all; ``kill -9 <pid>`` one): the others go on, and
its torchrun agent restarts it; it heals from a live peer and trains on. Each replica prints
who trains together whenever that changes. See docs/fault-tolerance.md.
"""
import argparse
import os
import time

import torch

import distopt
from distopt.fault_tolerance.manager import make_manager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=96, help="kept whatever the number of replicas")
    args = parser.parse_args()
    manager = make_manager()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = distopt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), fault_tolerance=manager)
    opt.fault_tolerance.on_world_change = lambda event: print(f"[replica {os.environ.get('REPLICA_GROUP_ID', 0)}] {event.describe()}",
                                                              flush=True)
    target = torch.randn(16, generator=torch.Generator().manual_seed(7))
    try:
        while manager.current_step() < args.steps:
            opt.zero_grad()
            # Keep the effective batch: each replica takes its share of the global batch (the world of the
            # last step; the mean is over the replicas taking part).
            world = max(opt.fault_tolerance.world_size, 1)
            g = torch.Generator().manual_seed(manager.current_step() * 1000 + opt.fault_tolerance.rank)
            x = torch.randn(args.global_batch // world, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target).unsqueeze(1))
            loss.backward()
            opt.step()
            if manager.current_step() % 50 == 0:
                print(f"step {manager.current_step()} loss {loss.item():.4f} world {world}", flush=True)
            time.sleep(0.01)
    finally:
        manager.shutdown(wait=True)


if __name__ == "__main__":
    main()
