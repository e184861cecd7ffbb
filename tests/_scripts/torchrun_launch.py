"""Run under torchrun: the same script that would spawn workers runs fn once per torchrun rank.

Usage: ``torchrun ... torchrun_launch.py OUT_DIR``; each rank writes ``OUT_DIR/rank<RANK>.json``.
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
