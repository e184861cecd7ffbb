"""The smallest job that aborted at exit: build an optimizer after the group exists, gather, shut down, exit.

Run under ``torchrun --nproc-per-node 2``. Building the first ``torch.optim``
optimizer imports ``torch.distributed.nn.functional``, which used to capture the
process group in its default arguments; the group then outlived ``shutdown()``
and a gloo thread finishing the last all-gather during interpreter exit aborted
the process. A warning from ``shutdown()`` (the group outlived it) is turned into
an error here, so the script fails on the cause and not only on the rare abort.
"""
import hashlib
import warnings

import torch
import torch.nn as nn

import distopt

if __name__ == "__main__":
    warnings.simplefilter("error", RuntimeWarning)
    distopt.init()
    torch.manual_seed(distopt.get_rank())
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = distopt.all_gather_object(digest)
    if len(set(digests)) != 1:
        raise SystemExit(f"ranks differ: {digests}")
    distopt.shutdown()
