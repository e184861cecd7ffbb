"""What the contenders train on a slow link, by name: two 12 MiB models timed per step, and a real task.

* ``transformer`` and ``mlp``: :data:`~distopt.benchmark.workloads.LINK_WORKLOADS`, the
  issue's two models with 12 MiB of gradients, on a fixed random batch per rank with
  SGD (momentum 0.9) as the rest of the benchmark: step time and bytes per step.
* ``charlm``: :class:`~.charlm.CharTransformer` on :class:`~.text.StdlibText` with
  AdamW, a new batch at every step: the loss it reaches, and when.

Each task has a full and a ``--quick`` :class:`Schedule`. Adding a task is one entry
in :data:`TASKS`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..workloads import LINK_WORKLOADS, Workload
from .charlm import CharTransformer, char_loss
from .text import StdlibText

__all__ = ["Batch", "Schedule", "LinkTask", "TASKS", "CHARLM_BATCH", "CHARLM_CONTEXT", "CHARLM_TEXT_BYTES"]

Batch = Tuple[Tensor, Tensor]

#: The real task's windows per rank per step, tokens per window and bytes of text.
CHARLM_BATCH, CHARLM_CONTEXT, CHARLM_TEXT_BYTES = 16, 64, 3_000_000
# Validation: 4 batches of 32 windows, evenly spaced over the last 10% of the text.
_VAL_BATCHES, _VAL_BATCH = 4, 32


@dataclass(frozen=True)
class Schedule:
    """How many steps a task runs, and how they are interleaved.

    Attributes:
        warmup: steps each contender runs, untimed and unrecorded, before the first round.
        rounds: rounds; in each, every contender runs ``chunk`` steps in turn.
        chunk: steps per contender per round.
        eval_every: rounds between two validation losses (0: none).
    """

    warmup: int
    rounds: int
    chunk: int
    eval_every: int = 0

    @property
    def steps(self) -> int:
        """Recorded steps per contender."""
        return self.rounds * self.chunk


@dataclass(frozen=True)
class LinkTask:
    """A model, its optimizer, its batches and its loss, and how long to train it.

    Attributes:
        name: the ``--tasks`` name.
        description: for the report.
        build_model: a fresh model; called right after seeding, so every contender and rank starts alike.
        make_optimizer: the inner optimizer over the model's parameters.
        batch: ``batch(rank, world, step, seed)``: rank ``rank``'s ``(input, target)`` at ``step``.
        loss_fn: ``loss_fn(model(input), target)``.
        full: the schedule of a full run.
        quick: the schedule of ``--quick``.
        real: a real task: the report gives the target loss, time to it and validation losses.
        val_batches: the validation batches (real tasks only).
        data_id: names the data, so two runs can tell whether they trained on the same (None: synthetic).
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch: Callable[[int, int, int, int], Batch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    full: Schedule
    quick: Schedule
    real: bool = False
    val_batches: Optional[Callable[[], List[Batch]]] = None
    data_id: Optional[Callable[[], str]] = None

    def schedule(self, quick: bool) -> Schedule:
        """The ``--quick`` schedule or the full one."""
        return self.quick if quick else self.full


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # As the rest of the benchmark: plain SGD with momentum, a small rate (the batch is fixed).
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9)


@functools.lru_cache(maxsize=None)
def _fixed_batch(name: str, rank: int, seed: int) -> Batch:
    # One batch per rank for the whole run, as in the step-time benchmark (process.make_batch's seeding).
    return LINK_WORKLOADS[name].make_batch(torch.Generator().manual_seed(seed * 1000 + rank))


def _workload_task(workload: Workload) -> LinkTask:
    return LinkTask(
        name=workload.name,
        description=workload.description,
        build_model=workload.build_model,
        make_optimizer=_sgd,
        batch=lambda rank, world, step, seed: _fixed_batch(workload.name, rank, seed),
        loss_fn=workload.loss_fn,
        # The measurement: 3 rounds of 8 steps; 3 warm-up steps get DDP past its bucket
        # rebuild and both PowerSGDs past their 2 uncompressed start steps.
        full=Schedule(warmup=3, rounds=3, chunk=8),
        quick=Schedule(warmup=2, rounds=1, chunk=3),
    )


@functools.lru_cache(maxsize=None)
def _text() -> StdlibText:
    return StdlibText(CHARLM_TEXT_BYTES)


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def _charlm_batch(rank: int, world: int, step: int, seed: int) -> Batch:
    return _text().batch(rank, world, step, CHARLM_BATCH, CHARLM_CONTEXT, seed)


def _charlm_val() -> List[Batch]:
    return _text().val_batches(_VAL_BATCHES, _VAL_BATCH, CHARLM_CONTEXT)


#: Every task, by name, in run order.
TASKS: Dict[str, LinkTask] = {
    **{name: _workload_task(w) for name, w in LINK_WORKLOADS.items()},
    "charlm": LinkTask(
        name="charlm",
        description=(f"char-level transformer LM (d 128, 4 layers, context {CHARLM_CONTEXT}, 3.2 MiB of gradients) "
                     f"on {CHARLM_TEXT_BYTES / 1e6:g} MB of the standard library's sources, AdamW lr 3e-3, "
                     f"{CHARLM_BATCH} windows per rank per step"),
        build_model=lambda: CharTransformer(context=CHARLM_CONTEXT),
        make_optimizer=_adamw,
        batch=_charlm_batch,
        loss_fn=char_loss,
        # 128 steps: with every contender of the table, a full run at 200 Mbit/s stays near 13 minutes on
        # two cores; the loss is still falling fast there, which is where speed of progress shows.
        full=Schedule(warmup=0, rounds=8, chunk=16, eval_every=2),
        quick=Schedule(warmup=0, rounds=2, chunk=8, eval_every=2),
        real=True,
        val_batches=_charlm_val,
        data_id=lambda: f"text sha256 {_text().digest}",
    ),
}
