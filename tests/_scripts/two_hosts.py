"""One node of a two-host job: ``python two_hosts.py NODE_RANK MASTER_ADDR PORT [link MARKER]``.

Run on each host (network namespace) of the test; prints one line of JSON with
what every local worker saw. With ``link MARKER`` the ranks train until an error
(the test takes a link down once rank 0 has written MARKER) and report it.
"""
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import distopt


def work():
    import distopt.horovod as hvd

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    hvd.init()
    model = torch.nn.Linear(4, 2)
    torch.manual_seed(dist.get_rank())  # different data per rank, same start (the wrapper broadcasts)
    opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    same = all(all(torch.equal(a, b) for a, b in zip(weights, other)) for other in distopt.all_gather_object(weights))
    opt.close()
    return {"rank": dist.get_rank(), "host": socket.gethostname(), "total": total.item(), "identical": same,
            "local_size": hvd.local_size(), "cross_size": hvd.cross_size(), "cross_rank": hvd.cross_rank()}


def train_until_it_breaks(marker):
    model = torch.nn.Linear(4, 2)
    opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stall_warning=2.0)
    start, began = None, time.monotonic()
    try:
        for step in range(100000):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            # a few of the stall inspector's ticks in (1 s each), however slow the host: positions have been published
            if start is None and step >= 20 and time.monotonic() - began > 2.5 and dist.get_rank() == 0:
                with open(marker, "w") as f:
                    f.write("training")
                start = time.monotonic()
            time.sleep(0.01)
    except RuntimeError as exc:
        waited = None if start is None else time.monotonic() - start
        return {"error": f"{type(exc).__name__}: {exc}", "seconds_after_marker": waited}
    return {"error": None}


if __name__ == "__main__":
    node_rank, master_addr, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if sys.argv[4:5] == ["link"]:
        try:
            results = distopt.launch(train_until_it_breaks, 1, args=(sys.argv[5],), nnodes=2, node_rank=node_rank,
                                     master_addr=master_addr, master_port=port, timeout=90, collective_timeout=5)
        except distopt.LaunchError as exc:
            results = [{"error": f"launch: {str(exc)[:300]}"}]
        print("RESULT " + json.dumps(results), flush=True)
        os._exit(0)
    results = distopt.launch(work, 1, nnodes=2, node_rank=node_rank, master_addr=master_addr, master_port=port,
                             timeout=90)
    print("RESULT " + json.dumps(results), flush=True)
