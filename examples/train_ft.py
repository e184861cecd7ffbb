"""Fault-tolerant training on one machine: run it under the launcher,

    RUST_LOG=warn python -m distopt.fault_tolerance.launch --replicas 3 examples/train_ft.py --steps 300

and kill a worker (``pkill -9 -f train_ft.py`` kills all; ``kill -9 <pid>`` one): the others go on, and
its torchrun agent restarts it; it heals from a live peer and trains on. Each replica prints
who trains together whenever that changes. See docs/fault-tolerance.md.

Streaming DiLoCo instead of synchronous steps (each fragment's sync a fault-tolerant step)::

    RUST_LOG=warn python -m distopt.fault_tolerance.launch --replicas 3 examples/train_ft.py --steps 100 \\
        --sync-every 16 --fragments 4 --overlap 2
"""
import argparse
import os
import time

import torch

import distopt
from distopt.fault_tolerance.manager import make_manager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300,
                        help="committed steps: every step, or with --sync-every every sync (of a fragment)")
    parser.add_argument("--global-batch", type=int, default=96, help="kept whatever the number of replicas")
    parser.add_argument("--sync-every", type=int, default=1, help="DiLoCo: local steps between two syncs (H)")
    parser.add_argument("--fragments", type=int, default=None, help="streaming DiLoCo: fragments (F)")
    parser.add_argument("--overlap", type=int, default=None, help="streaming DiLoCo: inner steps a sync travels")
    args = parser.parse_args()
    manager = make_manager()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    diloco = {}
    if args.sync_every > 1:
        diloco = dict(sync_every=args.sync_every, sync_fragments=args.fragments, sync_overlap=args.overlap,
                      outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    opt = distopt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), fault_tolerance=manager,
                                       **diloco)
    replica = os.environ.get("REPLICA_GROUP_ID", 0)
    opt.fault_tolerance.on_world_change = lambda event: print(f"[replica {replica}] {event.describe()}", flush=True)
    target = torch.randn(16, generator=torch.Generator().manual_seed(7))
    inner = 0
    try:
        while manager.current_step() < args.steps:
            opt.zero_grad()
            # Keep the effective batch: each replica takes its share of the global batch (the world of the
            # last step; the mean is over the replicas taking part).
            world = max(opt.fault_tolerance.world_size, 1)
            g = torch.Generator().manual_seed(inner * 1000 + int(replica))
            x = torch.randn(args.global_batch // world, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target).unsqueeze(1))
            loss.backward()
            opt.step()
            inner += 1
            if inner % 50 == 0:
                print(f"[replica {replica}] step {inner} committed {manager.current_step()} loss {loss.item():.4f} "
                      f"world {world}", flush=True)
            time.sleep(0.01)
        print(f"[replica {replica}] done: {inner} steps, {manager.current_step()} committed, loss {loss.item():.4f}",
              flush=True)
    finally:
        manager.shutdown(wait=True)


if __name__ == "__main__":
    main()
