"""Run under torchrun: set the process group up, shut it down, and set it up again, three times.

Each set-up must meet the others' fresh addresses, not the stale ones an earlier set-up left
in torchrun's store. Prints one line per set-up: ``setup K: sum S``.
"""
import torch
import torch.distributed as dist

import distopt

if __name__ == "__main__":
    for setup in range(3):
        distopt.init()
        total = torch.tensor([float(dist.get_rank() + 1 + setup)])
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"setup {setup}: sum {total.item():g}", flush=True)
        distopt.shutdown()
