"""Gradient accumulation with backward_passes_per_step (the pattern of Horovod's pytorch_imagenet_resnet50.py).

Horovod code except for the import line; run under torchrun by tests/horovod/test_horovod.py.
Each step splits an ``allreduce batch`` into ``--batches-per-allreduce`` sub-batches
and calls backward() on each; the last batch of an epoch has fewer sub-batches, so
step() must reduce what was accumulated. Trains on scikit-learn's digits with a
learning-rate warm-up, checkpoints on rank 0 and resumes from the newest checkpoint.
"""
import argparse
import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.utils.data import TensorDataset

import distopt.horovod as hvd

parser = argparse.ArgumentParser(description="Digits with gradient accumulation")
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar",
                    help="checkpoint file format")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--batches-per-allreduce", type=int, default=1,
                    help="number of batches processed locally before executing allreduce across workers; "
                         "it multiplies total batch size.")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--base-lr", type=float, default=0.0125, help="learning rate for a single GPU")
parser.add_argument("--warmup-epochs", type=float, default=1, help="number of warmup epochs")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--wd", type=float, default=0.00005, help="weight decay")
parser.add_argument("--seed", type=int, default=42, help="random seed")


def load_digits(seed):
    # Read scikit-learn's data file: importing scikit-learn would only slow every worker's start.
    spec = importlib.util.find_spec("sklearn")
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    images = torch.tensor(data[:, :-1], dtype=torch.float32) / 16.0
    labels = torch.tensor(data[:, -1], dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    return (TensorDataset(images[order[:cut]], labels[order[:cut]]),
            TensorDataset(images[order[cut:]], labels[order[cut:]]))


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    train_loss = Metric("train_loss")
    train_accuracy = Metric("train_accuracy")
    steps = sub_batches = 0
    for batch_idx, (data, target) in enumerate(train_loader):
        adjust_learning_rate(epoch, batch_idx)
        optimizer.zero_grad()
        # Split data into sub-batches of size batch_size
        sub_batches = math.ceil(float(len(data)) / args.batch_size)
        for i in range(0, len(data), args.batch_size):
            data_batch = data[i:i + args.batch_size]
            target_batch = target[i:i + args.batch_size]
            output = model(data_batch)
            train_accuracy.update(accuracy(output, target_batch))
            loss = F.cross_entropy(output, target_batch)
            train_loss.update(loss)
            # Average gradients among sub-batches
            loss.div_(math.ceil(float(len(data)) / args.batch_size))
            loss.backward()
        # Gradient is applied across all ranks
        optimizer.step()
        steps += 1
    if verbose:
        print("epoch %d steps %d (the last with %d of %d sub-batches) train loss %.4f train accuracy %.4f"
              % (epoch + 1, steps, sub_batches, args.batches_per_allreduce, train_loss.avg.item(),
                 train_accuracy.avg.item()), flush=True)


def validate(epoch):
    model.eval()
    val_loss = Metric("val_loss")
    val_accuracy = Metric("val_accuracy")
    with torch.no_grad():
        for data, target in val_loader:
            output = model(data)
            val_loss.update(F.cross_entropy(output, target))
            val_accuracy.update(accuracy(output, target))
    if verbose:
        print("epoch %d val loss %.4f val accuracy %.4f" % (epoch + 1, val_loss.avg.item(), val_accuracy.avg.item()),
              flush=True)


# Horovod: using `lr = base_lr * hvd.size()` from the very beginning leads to worse final
# accuracy. Scale the learning rate `lr = base_lr` ---> `lr = base_lr * hvd.size()` during
# the first five epochs. See https://arxiv.org/abs/1706.02677 for details.
def adjust_learning_rate(epoch, batch_idx):
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / len(train_loader)
        lr_adj = 1. / hvd.size() * (epoch * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 1.
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def accuracy(output, target):
    # get the index of the max log-probability
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).float().mean()


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=epoch + 1)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, filepath)


# Horovod: average metrics from distributed training.
class Metric(object):
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


if __name__ == "__main__":
    args = parser.parse_args()
    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    # If set > 0, will resume training from a given checkpoint.
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break

    # Horovod: broadcast resume_from_epoch from rank 0 (which will have
    # checkpoints) to other ranks.
    resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0, name="resume_from_epoch")

    # Horovod: print logs on the first worker.
    verbose = 1 if hvd.rank() == 0 else 0

    train_dataset, val_dataset = load_digits(args.seed)
    # Horovod: use DistributedSampler to partition data among workers. Manually specify
    # `num_replicas=hvd.size()` and `rank=hvd.rank()`.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler)
    val_sampler = torch.utils.data.distributed.DistributedSampler(
        val_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=64, sampler=val_sampler)

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    # Horovod: scale learning rate by the number of GPUs.
    optimizer = optim.SGD(model.parameters(),
                          lr=(args.base_lr * args.batches_per_allreduce * hvd.size()),
                          momentum=args.momentum, weight_decay=args.wd)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    # Restore from a previous checkpoint, if initial_epoch is specified.
    # Horovod: restore on the first worker which will broadcast weights to other workers.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=resume_from_epoch)
        checkpoint = torch.load(filepath)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if verbose:
        print("resuming from epoch %d" % resume_from_epoch, flush=True)
    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch)
        validate(epoch)
        save_checkpoint(epoch)

    fingerprint = sum(float(p.detach().double().sum()) for p in model.parameters())
    fingerprints = hvd.allgather_object(fingerprint)
    if verbose:
        print("parameters identical: %s" % (len(set(fingerprints)) == 1), flush=True)
