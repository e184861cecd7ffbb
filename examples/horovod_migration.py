"""Migrating from Horovod: a Horovod training script, run by distopt.

This is a Horovod PyTorch script in the style of Horovod's own MNIST example
(on scikit-learn's 8x8 digits, which need no download). Moving it off Horovod
changes two things, the import and the launcher::

    -import horovod.torch as hvd
    +import distopt.horovod as hvd

    -horovodrun -np 2 python examples/horovod_migration.py
    +torchrun --nproc-per-node 2 examples/horovod_migration.py

Everything else (``hvd.init()``, ``hvd.DistributedOptimizer``, the broadcasts,
``hvd.allreduce`` for metrics, mixed precision with ``optimizer.synchronize()``
and ``optimizer.skip_synchronize()``) is unchanged Horovod code.
``python examples/horovod_migration.py`` runs it as a job of one process.

Options as in Horovod's example: ``--fp16-allreduce`` sends gradients as
float16, ``--use-mixed-precision`` trains under autocast with a GradScaler
(bfloat16 on CPU, float16 on GPU), ``--gradient-predivide-factor``.
"""
import argparse
import hashlib
import importlib.util
from pathlib import Path
from typing import Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.utils.data import TensorDataset

import distopt.horovod as hvd

__all__ = ["Net", "load_digits", "parse_args", "metric_average", "train", "test", "parameters_digest", "main"]


class Net(nn.Module):
    """Two convolutions and two linear layers for 8x8 digits, as Horovod's MNIST ``Net`` for 28x28."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.dropout(F.relu(self.fc1(x)), p=0.1, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def load_digits(seed: int) -> Tuple[TensorDataset, TensorDataset]:
    """Train and test sets of scikit-learn's digits (80/20, the same split on every rank)."""
    # Read scikit-learn's data file: importing scikit-learn would only slow every worker's start.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits come with scikit-learn, which is not installed: pip install scikit-learn")
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    images = torch.tensor(data[:, :-1], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(data[:, -1], dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def parse_args() -> argparse.Namespace:
    """The command line of Horovod's MNIST example (without Adasum); see ``--help``."""
    parser = argparse.ArgumentParser(description="Horovod-style digits training, run by distopt.horovod")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank (default: 32)")
    parser.add_argument("--test-batch-size", type=int, default=200, help="test batch size (default: 200)")
    parser.add_argument("--epochs", type=int, default=6, help="number of epochs to train (default: 6)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate per rank (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between progress lines")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                        help="use mixed precision for training")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                        help="apply gradient predivide factor in optimizer (default: 1.0)")
    return parser.parse_args()


def metric_average(val: Union[float, torch.Tensor], name: str) -> float:
    """The average of ``val`` over all ranks (Horovod's helper of the same name)."""
    tensor = torch.as_tensor(val, dtype=torch.float32)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch: int, model: nn.Module, optimizer: hvd.DistributedOptimizer,
          train_sampler: torch.utils.data.distributed.DistributedSampler, train_loader: torch.utils.data.DataLoader,
          scaler: Optional[torch.amp.GradScaler], args: argparse.Namespace) -> None:
    """One epoch on this rank's shard; with ``scaler``, under autocast with Horovod's AMP pattern."""
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        if scaler is not None:
            with torch.autocast(args.device_type, dtype=args.amp_dtype):
                output = model(data)
                loss = F.nll_loss(output.float(), target)
            scaler.scale(loss).backward()
            # Make sure all async allreduces are done
            optimizer.synchronize()
            # In-place unscaling of all gradients before weights update
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            # Update scaler in case of overflow/underflow
            scaler.update()
        else:
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in this worker's partition.
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(train_sampler),
                100.0 * batch_idx / len(train_loader), loss.item()), flush=True)


def test(model: nn.Module, test_sampler: torch.utils.data.distributed.DistributedSampler,
         test_loader: torch.utils.data.DataLoader, args: argparse.Namespace) -> float:
    """Evaluate on this rank's shard of the test set; print and return the accuracy averaged over ranks."""
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()

    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print("\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n".format(test_loss, 100.0 * test_accuracy),
              flush=True)
    return test_accuracy


def parameters_digest(model: nn.Module) -> str:
    """A SHA-256 of the model's parameters and buffers, to check that all ranks agree."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    """Train and evaluate; finally check that every rank holds the same parameters."""
    args = parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    args.device_type = "cuda" if args.cuda else "cpu"
    args.amp_dtype = torch.float16 if args.cuda else torch.bfloat16

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        if hvd.local_rank() >= torch.cuda.device_count():
            raise SystemExit(f"local rank {hvd.local_rank()} has no GPU of its own ({torch.cuda.device_count()} "
                             "visible): start one process per GPU, or pass --no-cuda")
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset, test_dataset = load_digits(args.seed)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size()
    if args.cuda:
        model.cuda()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    scaler = torch.amp.GradScaler(args.device_type) if args.use_mixed_precision else None

    for epoch in range(1, args.epochs + 1):
        train(epoch, model, optimizer, train_sampler, train_loader, scaler, args)
        test(model, test_sampler, test_loader, args)

    digests = hvd.allgather_object(parameters_digest(model))
    if hvd.rank() == 0:
        same = len(set(digests)) == 1
        print(f"parameters {'identical' if same else 'DIFFER'} on all {hvd.size()} rank(s)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
