"""Run under torchrun: the same script that would spawn workers runs fn once per torchrun rank.

Then the process group that launch() set up is shut down and set up again, three times: each
set-up must meet the others' fresh addresses, not the stale ones an earlier set-up left in
torchrun's store (one torchrun job for both: each costs seconds of process start-up).

Usage: ``torchrun ... torchrun_launch.py OUT_DIR``; each rank writes ``OUT_DIR/rank<RANK>.json``,
and rank 0 prints one line per set-up again: ``setup K: sum S``.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import distopt


def work(scale):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "sum": total.item() * scale,
        "helper_rank": distopt.get_rank(),
    }


@distopt.launcher(nprocs=2)
def decorated():
    return dist.get_world_size()


if __name__ == "__main__":
    results = distopt.launch(work, args=(10,))
    decorated_results = decorated()
    out = Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps({
        "launch": results,
        "decorated": decorated_results,
        "initialized_after": dist.is_initialized(),
    }))
    distopt.shutdown()
    for setup in range(3):
        distopt.init()
        total = torch.tensor([float(dist.get_rank() + 1 + setup)])
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"setup {setup}: sum {total.item():g}", flush=True)
        distopt.shutdown()
