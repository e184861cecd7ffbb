"""The models the benchmark times, by name.

A workload is a model, a fixed per-rank batch and a loss. Adding one is one
:class:`Workload` entry in :data:`WORKLOADS`; ``--workloads`` and
:class:`~distopt.benchmark.BenchConfig` pick them by name.

:data:`LINK_WORKLOADS` holds the two 12 MiB models of the slow-link benchmark
(``--link``, :mod:`distopt.benchmark.slow_link`): larger versions of ``transformer`` and
``mlp``, sized so that sending their gradients over a slow link costs more than
computing them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn

__all__ = ["Batch", "LossFn", "Workload", "WORKLOADS", "LINK_WORKLOADS"]

Batch = Tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Workload:
    """A model, a fixed per-rank batch and a loss; ``iters_scale`` multiplies ``--iters``.

    Attributes:
        name: the key in :data:`WORKLOADS` and the ``--workloads`` name.
        description: what the model is, for the report.
        build_model: makes a fresh model; called right after seeding, so every mode and rank
            starts from the same weights. It must honour a ``torch.device`` context: the
            parameter count builds it on ``meta``.
        make_batch: makes ``(input, target)`` from a seeded generator (one seed per rank).
        loss_fn: ``loss_fn(model(input), target)`` is the loss.
        iters_scale: multiplies ``--iters`` for workloads whose steps are short and noisy.
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]
    loss_fn: LossFn
    iters_scale: int = 1


def _mlp_model() -> nn.Module:
    # 50 tiny Linear layers: 100 parameters of at most 4 KiB, so per-parameter hook and
    # launch overhead dominates, not bandwidth.
    layers: List[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers)


def _mlp_batch(gen: torch.Generator) -> Batch:
    return torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)


def _wide_model() -> nn.Module:
    # 4 parameters, ~128 MiB of fp32 gradients: copies and bandwidth dominate.
    return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))


def _wide_batch(gen: torch.Generator) -> Batch:
    return torch.randn(8, 4096, generator=gen), torch.randn(8, 4096, generator=gen)


class _TransformerModel(nn.Module):
    """A 4-layer ``nn.TransformerEncoder`` with a linear head: a realistic mix of sizes."""

    def __init__(self, d_model: int = 128, nhead: int = 4, layers: int = 4) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x))


def _transformer_batch(gen: torch.Generator) -> Batch:
    return torch.randn(8, 32, 128, generator=gen), torch.randn(8, 32, 128, generator=gen)


class _ConvNet(nn.Module):
    """A small conv net with batch norm: many small parameters, buffers that are not parameters."""

    def __init__(self, width: int = 32, blocks: int = 4) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(blocks - 1):
            layers += [nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def _conv_batch(gen: torch.Generator) -> Batch:
    return torch.randn(16, 3, 32, 32, generator=gen), torch.randn(16, 10, generator=gen)


class _EmbeddingModel(nn.Module):
    """A 64 MiB embedding table (dense gradients) and a small head: one huge gradient, mostly zeros."""

    def __init__(self, rows: int = 131072, dim: int = 128) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.table(x))


def _embedding_batch(gen: torch.Generator) -> Batch:
    return torch.randint(0, 131072, (32, 16), generator=gen), torch.randn(32, 16, 128, generator=gen)


#: Every workload, by name.
WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("mlp", "50 x Linear(32,32)", _mlp_model, _mlp_batch, nn.functional.mse_loss,
                 iters_scale=5),
        Workload("wide", "2 x Linear(4096,4096)", _wide_model, _wide_batch, nn.functional.mse_loss),
        Workload("transformer", "4-layer TransformerEncoder d=128", _TransformerModel, _transformer_batch,
                 nn.functional.mse_loss),
        Workload("conv", "4 x Conv2d(32)+BatchNorm2d, 32x32 images", _ConvNet, _conv_batch,
                 nn.functional.mse_loss, iters_scale=2),
        Workload("embedding", "Embedding(131072,128) (64 MiB) + 2 x Linear(128,128)", _EmbeddingModel,
                 _embedding_batch, nn.functional.mse_loss),
    )
}


def _mlp256_model() -> nn.Module:
    # 48 Linear(256, 256): 96 parameters (a weight and a bias each), 12.0 MiB of gradients, the
    # issue's "96 x 256^2" MLP; light compute, so on a slow link the step is almost all communication.
    layers: List[nn.Module] = []
    for _ in range(48):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers)


def _mlp256_batch(gen: torch.Generator) -> Batch:
    return torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)


def _transformer256_model() -> nn.Module:
    return _TransformerModel(d_model=256)


def _transformer256_batch(gen: torch.Generator) -> Batch:
    return torch.randn(8, 64, 256, generator=gen), torch.randn(8, 64, 256, generator=gen)


#: The slow-link benchmark's models (``--link``), by name: 12 MiB of gradients each. On one core of
#: the development machine a step takes about 130 ms (transformer) and 23 ms (mlp) without communication.
LINK_WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("transformer", "4-layer TransformerEncoder d=256, 12.3 MiB of gradients", _transformer256_model,
                 _transformer256_batch, nn.functional.mse_loss),
        Workload("mlp", "48 x Linear(256,256): 96 parameters, 12.0 MiB of gradients", _mlp256_model,
                 _mlp256_batch, nn.functional.mse_loss),
    )
}
