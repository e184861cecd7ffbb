"""A nanoGPT-style DDP training loop, and the same loop moved to distopt.

``train_ddp`` is the loop as a DDP script writes it: gradient accumulation through
``model.require_backward_grad_sync``, ``GradScaler``, gradient clipping, a
learning-rate schedule set on the param groups, and evaluation and checkpoints on
rank 0 only. ``train_distopt`` is the same loop after the migration; every line
that changed is marked ``# CHANGED``. docs/migrating-from-ddp.md explains each edit.

Both run on the same batches from the same start, and the script checks that they
end with the same parameters (to 1e-9, in float64), with ``shard_state=False``
and ``shard_state=True``, and that the rank-0 checkpoints load.

Usage::

    python examples/migrate_from_ddp.py                 # 2 processes (distopt.launch), CPU, gloo
    python examples/migrate_from_ddp.py --nprocs 1      # this process only, no process group
    torchrun --nproc-per-node 2 examples/migrate_from_ddp.py
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

import distopt


# ---------------------------------------------------------------------- a tiny GPT and its data


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, block_size: int = 16, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as in nanoGPT

    def forward(self, idx: Tensor, targets: Tensor):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=(0.9, 0.95))


def make_data(n: int = 4096, vocab: int = 64) -> Tensor:
    """A noisy counting sequence: the next token is mostly the last one plus one."""
    g = torch.Generator().manual_seed(0)
    steps = torch.where(torch.rand(n, generator=g) < 0.9, 1, torch.randint(vocab, (n,), generator=g))
    return torch.cumsum(steps, 0) % vocab


@dataclass
class Config:
    batch_size: int = 4
    block_size: int = 16
    gradient_accumulation_steps: int = 4  # over the whole job; each rank runs its share, as in nanoGPT
    max_iters: int = 6
    eval_interval: int = 3
    eval_iters: int = 2
    learning_rate: float = 1e-2
    min_lr: float = 1e-3
    warmup_iters: int = 2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    out_dir: str = os.path.join(tempfile.gettempdir(), "distopt-migrate-from-ddp")


def get_batch(data: Tensor, cfg: Config):
    ix = torch.randint(len(data) - cfg.block_size, (cfg.batch_size,))  # the global RNG: each rank its own
    x = torch.stack([data[i:i + cfg.block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + cfg.block_size] for i in ix])
    return x, y


def get_lr(it: int, cfg: Config) -> float:
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(model: nn.Module, splits, cfg: Config):
    model.eval()
    out = {}
    for name, data in splits.items():
        out[name] = sum(model(*get_batch(data, cfg))[1].item() for _ in range(cfg.eval_iters)) / cfg.eval_iters
    model.train()
    return out


# ---------------------------------------------------------------------- before: DDP


def train_ddp(cfg: Config, train_data: Tensor, val_data: Tensor) -> List[Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    master_process = rank == 0
    torch.manual_seed(1337 + rank)  # different starts: DDP broadcasts rank 0's parameters
    model = TinyGPT().double()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate)
    if ddp:
        model = DDP(model)
    raw_model = model.module if ddp else model
    accum = cfg.gradient_accumulation_steps // world

    X, Y = get_batch(train_data, cfg)
    for it in range(cfg.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, cfg)
        if it % cfg.eval_interval == 0 and master_process:
            estimate_loss(model, {"train": train_data, "val": val_data}, cfg)
            if it > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it}
                torch.save(checkpoint, os.path.join(cfg.out_dir, "ddp.pt"))
        for micro_step in range(accum):
            if ddp:
                model.require_backward_grad_sync = micro_step == accum - 1
            _, loss = model(X, Y)
            loss = loss / accum
            X, Y = get_batch(train_data, cfg)
            scaler.scale(loss).backward()
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in raw_model.parameters()]


# ---------------------------------------------------------------------- after: distopt


def train_distopt(cfg: Config, train_data: Tensor, val_data: Tensor, shard_state: bool) -> List[Tensor]:
    rank, world = distopt.get_rank(), distopt.get_world_size()  # CHANGED: 0 and 1 without a process group
    master_process = rank == 0
    torch.manual_seed(1337 + rank)  # different starts: the wrapper broadcasts rank 0's parameters
    model = TinyGPT().double()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    accum = cfg.gradient_accumulation_steps // world  # backward passes per step on this rank
    optimizer = distopt.DistributedOptimizer(  # CHANGED: wrap the optimizer, not the model
        model.configure_optimizers(cfg.weight_decay, cfg.learning_rate),
        backward_passes_per_step=accum,  # CHANGED: replaces require_backward_grad_sync
        named_parameters=model.named_parameters(), shard_state=shard_state)
    raw_model = model  # CHANGED: no .module

    X, Y = get_batch(train_data, cfg)
    for it in range(cfg.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, cfg)
        if it % cfg.eval_interval == 0:
            if master_process:
                estimate_loss(model, {"train": train_data, "val": val_data}, cfg)
            if it > 0:
                optimizer_state = optimizer.state_dict()  # CHANGED: on every rank (it gathers if sharded)
                if master_process:
                    checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer_state, "iter_num": it}
                    torch.save(checkpoint, os.path.join(cfg.out_dir, f"distopt-shard{int(shard_state)}.pt"))
                if shard_state:  # CHANGED: or one file per rank, no communication
                    torch.save(optimizer.sharded_state_dict(), os.path.join(cfg.out_dir, f"optim-{rank}.pt"))
        for micro_step in range(accum):
            _, loss = model(X, Y)
            loss = loss / accum  # the passes are summed, as in DDP: divide here
            X, Y = get_batch(train_data, cfg)
            scaler.scale(loss).backward()
        optimizer.synchronize()  # CHANGED: gradients final even if a rank lagged (rank 0 evaluated alone)
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    optimizer.close()
    return [p.detach().clone() for p in raw_model.parameters()]


# ---------------------------------------------------------------------- the check


def run(cfg: Config) -> bool:
    data = make_data()
    train_data, val_data = data[:3686], data[3686:]
    rank, world = distopt.get_rank(), distopt.get_world_size()
    os.makedirs(cfg.out_dir, exist_ok=True)
    reference = train_ddp(cfg, train_data, val_data)
    what = "DDP" if world > 1 else "the plain loop"
    ok = True
    for shard_state in (False, True):
        params = train_distopt(cfg, train_data, val_data, shard_state)
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        everyone = distopt.all_gather_object(params)
        identical = all(torch.equal(a, b) for other in everyone for a, b in zip(params, other))
        ok &= diff < 1e-9 and identical
        if rank == 0:
            print(f"shard_state={shard_state!s:5}  world {world}: parameters match {what}'s "
                  f"(max difference {diff:.1e}); ranks bitwise identical: {identical}", flush=True)
    distopt.barrier()  # every rank's files are written
    if rank == 0:
        gathered = torch.load(os.path.join(cfg.out_dir, "distopt-shard1.pt"))["optimizer"]
        merged = distopt.merge_state_dicts(
            [torch.load(os.path.join(cfg.out_dir, f"optim-{r}.pt")) for r in range(world)])
        same = all(torch.equal(gathered["state"][k][n], v) for k, s in merged["state"].items() for n, v in s.items())
        plain = TinyGPT().double().configure_optimizers(cfg.weight_decay, cfg.learning_rate)
        plain.load_state_dict(gathered)  # the gathered checkpoint is a plain AdamW state dict
        print(f"checkpoint: the gathered state dict loads into a plain AdamW; the merged per-rank shards "
              f"equal it: {same}", flush=True)
        ok &= same
    return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="worker processes; 1: this process, no process "
                        "group; ignored under torchrun")
    args = parser.parse_args(argv)
    cfg = Config()
    if args.nprocs == 1 and "RANK" not in os.environ:
        results = [run(cfg)]
    else:  # under torchrun, launch runs in this process instead of spawning
        results = distopt.launch(run, nprocs=args.nprocs, args=(cfg,), backend="gloo")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
