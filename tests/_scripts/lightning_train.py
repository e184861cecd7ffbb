"""Train one small LightningModule several ways under Lightning's own launcher (2 CPU ranks).

Usage: python lightning_train.py OUT_DIR RUN [RUN ...]; each RUN is a name from RUNS. Every rank
saves its parameters after each run as OUT_DIR/RUN-rankR.pt, so the test compares runs and ranks.
Lightning starts rank 1 by running this script again, with the same arguments.
"""
import os
import sys

import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import distopt
from distopt.lightning import DistoptStrategy

BATCHES_PER_EPOCH = 8  # 256 samples, 2 ranks, batches of 16


class Regression(pl.LightningModule):
    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)}


def fit(strategy, steps, out=None, ckpt_dir=None, ckpt_path=None, optimizer="adam", **trainer_args):
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=gen), torch.randn(256, 1, generator=gen))
    model = Regression(optimizer)
    callbacks = [] if ckpt_dir is None else [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=steps,
                                                            save_top_k=-1)]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=ckpt_dir is not None, callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, **trainer_args)
    trainer.fit(model, DataLoader(data, batch_size=16), ckpt_path=ckpt_path)
    if out is not None:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   f"{out}-rank{trainer.global_rank}.pt")
    return trainer


def resumed(out, strategy_factory, steps, **trainer_args):
    """``steps`` in two halves, the second from the first's checkpoint (at an epoch's end)."""
    ckpt_dir = out + "-ckpt"
    fit(strategy_factory(), steps // 2, ckpt_dir=ckpt_dir, **trainer_args)
    [name] = [n for n in sorted(os.listdir(ckpt_dir)) if n.endswith(".ckpt")]
    fit(strategy_factory(), steps, out=out, ckpt_path=os.path.join(ckpt_dir, name), **trainer_args)


def initial(out):
    pl.seed_everything(0, verbose=False)
    torch.save(Regression().state_dict(), f"{out}-rank0.pt")


STEPS = 2 * BATCHES_PER_EPOCH
RUNS = {
    "initial": initial,
    "ddp": lambda out: fit("ddp", STEPS, out),
    "distopt": lambda out: fit(DistoptStrategy(), STEPS, out),
    "ddp-accumulate-clip": lambda out: fit("ddp", STEPS, out, accumulate_grad_batches=2, gradient_clip_val=0.05),
    "distopt-accumulate-clip": lambda out: fit(DistoptStrategy(), STEPS, out, accumulate_grad_batches=2,
                                               gradient_clip_val=0.05),
    "ddp-bf16": lambda out: fit("ddp", STEPS, out, precision="bf16-mixed"),
    "distopt-bf16": lambda out: fit(DistoptStrategy(), STEPS, out, precision="bf16-mixed"),
    "distopt-resumed": lambda out: resumed(out, DistoptStrategy, STEPS),
    "distopt-sharded-resumed": lambda out: resumed(out, lambda: DistoptStrategy(shard_state=True), STEPS),
    "distopt-int8": lambda out: fit(DistoptStrategy(compression="int8"), STEPS, out),
    "distopt-int8-resumed": lambda out: resumed(out, lambda: DistoptStrategy(compression="int8"), STEPS),
    "distopt-local-sgd": lambda out: fit(DistoptStrategy(sync_every=4), STEPS, out, optimizer="sgd"),
    "distopt-diloco": lambda out: fit(DistoptStrategy(sync_every=4, outer_optimizer=lambda ps: torch.optim.SGD(
        ps, lr=0.7, momentum=0.9, nesterov=True)), STEPS, out, optimizer="sgd"),
    "distopt-streaming": lambda out: fit(DistoptStrategy(sync_every=4, sync_fragments=2, outer_optimizer=lambda ps:
        torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)), STEPS, out, optimizer="sgd"),
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        RUNS[name](os.path.join(out_dir, name))
    distopt.shutdown()
