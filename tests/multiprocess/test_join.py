"""Uneven inputs: ``with opt.join():`` lets ranks run different numbers of steps.

Every case trains like a single process that averages, at each step, the
gradients of the ranks that still have data (float64, 1e-10), and every rank
leaves the block with bitwise-identical parameters and optimizer state. The
checks of one world run in one launch; each returns what it measured.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import DistributedOptimizer

from _drift_outcome import checks_at_the_top
from _worlds import Worlds

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(300)]

TOL = 1e-10
ROWS = 6  # rows per rank and step


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def state_tensors(optimizer, params):
    out = []
    for p in params:
        for key in sorted(optimizer.state.get(p, {})):
            value = optimizer.state[p][key]
            out.append(value if torch.is_tensor(value) else torch.tensor(value))
    return out


def reference(counts, opt_name, divide_by_world=False, bcast_period=0, unfreeze_at=None):
    """Single-process training: at step t, average the gradients of the ranks with more than t batches.

    With ``unfreeze_at``, the first layer is frozen until that step.
    """
    model = make_model()
    set_first_layer_frozen(model, unfreeze_at is not None)
    opt = OPTIMIZERS[opt_name](model.parameters())
    world = len(counts)
    for step in range(max(counts)):
        if step == unfreeze_at:
            set_first_layer_frozen(model, False)
        present = [r for r in range(world) if counts[r] > step]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in present:
            model.zero_grad()
            loss_of(model, *batch(r, step)).backward()
            for g, p in zip(grads, model.parameters()):
                if p.grad is not None:
                    g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / (world if divide_by_world else len(present)) if p.requires_grad else None
        opt.step()
    return list(model.parameters()), state_tensors(opt, list(model.parameters()))


def set_first_layer_frozen(model, frozen):
    for p in model[0].parameters():
        p.requires_grad_(not frozen)


def train_uneven(counts, opt_name, *, passes=1, compression=None, divide_by_world=False, bcast_period=0,
                 no_sync_first=False, threshold=64, unfreeze_at=None):
    rank = dist.get_rank()
    model = make_model(seed=rank)  # the construction broadcast aligns them
    set_first_layer_frozen(model, unfreeze_at is not None)
    opt = DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()), backward_passes_per_step=passes,
                               compression=compression, bcast_period=bcast_period, pack_threshold=threshold)
    with opt.join(divide_by_world=divide_by_world):
        for step in range(counts[rank]):
            if step == unfreeze_at:  # the ranks that joined already follow
                set_first_layer_frozen(model, False)
            x, y = batch(rank, step)
            opt.zero_grad()
            if no_sync_first:  # half the batch without communication, the other half reduces
                with opt.no_sync():
                    (loss_of(model, x[:3], y[:3]) / 2).backward()
                (loss_of(model, x[3:], y[3:]) / 2).backward()
            else:
                for chunk in range(passes):
                    rows = slice(chunk * ROWS // passes, (chunk + 1) * ROWS // passes)
                    (loss_of(model, x[rows], y[rows]) / passes).backward()
            opt.step()
    params = list(model.parameters())
    mine = [t.detach().clone() for t in params + state_tensors(opt, params)]
    everyone = distopt.all_gather_object(mine)
    identical = all(all(torch.equal(a, b) for a, b in zip(mine, other)) and len(mine) == len(other)
                    for other in everyone)
    ref_params, ref_state = reference(counts, opt_name, divide_by_world, unfreeze_at=unfreeze_at)
    diff = max((a - b).abs().max().item() for a, b in zip(params + state_tensors(opt, params),
                                                            ref_params + ref_state))
    steps = opt._engine.steps
    opt.close()
    return {"identical": identical, "diff": diff, "steps": steps}


def train_lbfgs_uneven(counts):
    rank = dist.get_rank()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3), pack_threshold=64)
    with opt.join():
        for step in range(counts[rank]):
            x, y = batch(rank, step)

            def closure():
                opt.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                return loss

            opt.step(closure)
    mine = [p.detach().clone() for p in model.parameters()]
    return all(all(torch.equal(a, b) for a, b in zip(mine, o)) for o in distopt.all_gather_object(mine))


def lbfgs_reference(counts, line_search, dtype=torch.float64):
    """One process: at step t, LBFGS's closure returns the mean loss of the ranks with more than t batches."""
    model = make_model().to(dtype)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn=line_search)
    losses = []
    for step in range(max(counts)):
        present = [r for r in range(len(counts)) if counts[r] > step]

        def closure():
            opt.zero_grad()
            loss = sum(loss_of(model, *[t.to(dtype) for t in batch(r, step)]) for r in present) / len(present)
            loss.backward()
            return loss

        losses.append(opt.step(closure).item())
    return list(model.parameters()), losses


def lbfgs_against_a_single_process(counts, line_search=None, dtype=torch.float64):
    """LBFGS inside join(): the closure's loss and gradients are the means over the ranks still training."""
    rank = dist.get_rank()
    model = make_model(seed=rank).to(dtype)
    opt = DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn=line_search),
                               pack_threshold=64, stall_timeout=30)  # ranks out of step fail in time
    losses = []
    with opt.join():
        for step in range(counts[rank]):
            x, y = [t.to(dtype) for t in batch(rank, step)]

            def closure():
                opt.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                return loss

            losses.append(opt.step(closure).item())
    mine = [p.detach().clone() for p in model.parameters()]
    identical = all(all(torch.equal(a, b) for a, b in zip(mine, o)) for o in distopt.all_gather_object(mine))
    ref_params, ref_losses = lbfgs_reference(counts, line_search, dtype)
    opt.close()
    return {"identical": identical, "diff": max((a - b).abs().max().item() for a, b in zip(mine, ref_params)),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)) if losses else 0.0,
            "losses": len(losses)}


def join_on_some_ranks_only():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    block = opt.join() if dist.get_rank() == 0 else _nothing()
    try:
        with block:
            opt.zero_grad()
            loss_of(model, *batch(dist.get_rank(), 0)).backward()
            opt.step()
        return ("ok",)
    except RuntimeError as exc:
        return ("error", str(exc))
    finally:
        opt.close()


def leave_without_a_block_while_another_rank_joins():
    """Rank 1 has no data and no join block: it closes its optimizer and leaves, while rank 0 trains inside one."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if dist.get_rank() == 1:
        opt.close()
        return ("left",)
    try:
        with opt.join():
            for step in range(2):
                opt.zero_grad()
                loss_of(model, *batch(0, step)).backward()
                opt.step()
        return ("ok",)
    except RuntimeError as exc:
        return ("error", str(exc))
    finally:
        opt.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def two_optimizers_uneven(counts):
    """A GAN-like loop: optimizer a steps twice per step of optimizer b; both join together."""
    rank = dist.get_rank()
    model_a, model_b = make_model(seed=rank), make_model(seed=10 + rank)
    opt_a = DistributedOptimizer(torch.optim.SGD(model_a.parameters(), lr=0.05, momentum=0.9))
    opt_b = DistributedOptimizer(torch.optim.Adam(model_b.parameters(), lr=0.01))
    with distopt.join(opt_a, opt_b):
        for step in range(counts[rank]):
            x, y = batch(rank, step)
            for _ in range(2):
                opt_a.zero_grad()
                loss_of(model_a, x, y).backward()
                opt_a.step()
            opt_b.zero_grad()
            loss_of(model_b, x, y).backward()
            opt_b.step()
    mine = [p.detach().clone() for p in list(model_a.parameters()) + list(model_b.parameters())]
    mine += state_tensors(opt_b, list(model_b.parameters()))
    identical = all(all(torch.equal(a, b) for a, b in zip(mine, o)) for o in distopt.all_gather_object(mine))
    opt_a.close()
    opt_b.close()
    expected = _two_optimizers_reference(counts)
    return identical, max((a - b).abs().max().item() for a, b in zip(mine, expected))


def _two_optimizers_reference(counts):
    """One process: each step, every optimizer steps on the mean gradient of the ranks still training."""
    model_a, model_b = make_model(seed=0), make_model(seed=10)  # the construction broadcast gives rank 0's
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.Adam(model_b.parameters(), lr=0.01)

    def mean_step(model, opt, present, step):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in present:
            model.zero_grad()
            loss_of(model, *batch(r, step)).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(present)
        opt.step()

    for step in range(max(counts)):
        present = [r for r, count in enumerate(counts) if count > step]
        for _ in range(2):
            mean_step(model_a, opt_a, present, step)
        mean_step(model_b, opt_b, present, step)
    return [p.detach() for p in list(model_a.parameters()) + list(model_b.parameters())] + \
        state_tensors(opt_b, list(model_b.parameters()))


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: it orders when the two tables' gradients are ready."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(0.2)
        return grad


def _tables_loss(a, b, extra, rank, step, slow=False):
    n = 300 if step == 2 else 20  # at step 2 both tables' rows overflow their gathers
    ids = torch.randperm(4096, generator=torch.Generator().manual_seed(10 * step + rank))[:n]
    eb = b(ids)
    eb = _SlowBackward.apply(eb) if slow else eb
    ea = a(ids)  # made after eb: its gradient is ready first, then (after the sleep) b's
    return (eb ** 2).sum() + (ea ** 2).sum() + (extra ** 2).sum()  # extra's first of all: b's round opens first


def two_tables_overflowing_after_a_rank_joined():
    """Two optimizers joined together, one table each; rank 1 stops after one step. At step 2 both
    tables' rows overflow; rank 0 sends table a's rows first but ends table b's round first, so
    rank 1 must not block on a's dense all-reduce while rank 0 waits for b's."""
    import time

    rank = dist.get_rank()
    torch.manual_seed(0)
    a, b = nn.Embedding(4096, 32).double(), nn.Embedding(4096, 32).double()
    extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    ref = [nn.Embedding(4096, 32).double(), nn.Embedding(4096, 32).double(), nn.Parameter(extra.detach().clone())]
    ref[0].load_state_dict(a.state_dict())
    ref[1].load_state_dict(b.state_dict())
    opts = [DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), pack_threshold=1 << 20),
            DistributedOptimizer(torch.optim.SGD([*b.parameters(), extra], lr=0.1), pack_threshold=1 << 20)]
    ref_opt = torch.optim.SGD([*ref[0].parameters(), *ref[1].parameters(), ref[2]], lr=0.1)
    for opt in opts:  # a fixed 20 s at the end of backward, however slow earlier rounds were
        opt._engine.backward_patience, opt._engine.patience_growth = 20.0, 0.0
    slowest = 0.0
    with distopt.join(*opts):
        for step in range(4 if rank == 0 else 1):
            start = time.monotonic()
            for opt in opts:
                opt.zero_grad()
            _tables_loss(a, b, extra, rank, step, slow=step == 2).backward()
            for opt in opts:
                opt.step()
            slowest = max(slowest, time.monotonic() - start)
    for step in range(4):  # one process: the mean over the ranks still training
        ref_opt.zero_grad()
        present = [0, 1] if step == 0 else [0]
        (sum(_tables_loss(*ref, r, step) for r in present) / len(present)).backward()
        ref_opt.step()
    diff = max((a.weight - ref[0].weight).abs().max().item(), (b.weight - ref[1].weight).abs().max().item(),
               (extra - ref[2]).abs().max().item())
    gathered = [any(pack.rows is not None and pack.rows.cap > 0 for pack in opt._engine.packs) for opt in opts]
    return {"slowest": slowest, "diff": diff, "gathered": gathered}


def nested_blocks():
    model_a, model_b = make_model(), make_model()
    opt_a = DistributedOptimizer(torch.optim.SGD(model_a.parameters(), lr=0.05))
    opt_b = DistributedOptimizer(torch.optim.SGD(model_b.parameters(), lr=0.05))
    try:
        with opt_a.join():
            with opt_b.join():
                pass
    except RuntimeError as exc:
        return str(exc)
    finally:
        opt_a.close()
        opt_b.close()
    return "no error"


def horovod_join_uneven(counts):
    """Horovod's pattern: train on uneven data, then hvd.join(); joined ranks count as zeros."""
    import distopt.horovod as hvd

    hvd.init()  # on the existing process group
    rank = dist.get_rank()
    model = make_model(seed=rank)
    opt = hvd.DistributedOptimizer(OPTIMIZERS["momentum"](model.parameters()),
                                   named_parameters=model.named_parameters())
    for step in range(counts[rank]):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    last = hvd.join()
    params = list(model.parameters())
    mine = [t.detach().clone() for t in params + state_tensors(opt, params)]
    identical = all(all(torch.equal(a, b) for a, b in zip(mine, o)) for o in distopt.all_gather_object(mine))
    ref_params, ref_state = reference(counts, "momentum", divide_by_world=True)
    diff = max((a - b).abs().max().item() for a, b in zip(mine, ref_params + ref_state))
    return {"identical": identical, "diff": diff, "last": last}


# (world, check function, args, kwargs)
def _compressor(name):
    # PowerSGD of rank 1 compresses the 8 x 8 layer; its warm-started Q must not move in a probe round
    return distopt.compression.PowerSGD(rank=1) if name == "powersgd" else name


def check_drift_at_the_top(counts, two=False):
    """``opt.check_drift()`` at the top of every step inside the block: a rank that ran out of data at the end of
    the last step waits in a shadow round (with ``two``, one per optimizer of ``distopt.join(a, b)``: the check
    is a's, and its probe round must pair with a's), which no round has told the others of yet."""
    rank = dist.get_rank()
    models = [make_model(seed=rank), make_model(seed=10 + rank)][:1 + two]
    opts = [DistributedOptimizer(OPTIMIZERS[name](m.parameters()), pack_threshold=64, stall_timeout=10)
            for name, m in zip(("momentum", "adam"), models)]

    def train_step(t):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()

    result = checks_at_the_top(opts, counts[rank], train_step)
    for opt in opts:
        opt.close()
    return result


def check_drift_changes_nothing(counts, compression=None):
    """With ``check_drift()`` at the top of every step and between backward() and step() inside join() (each a
    probe round, then the check), the loop ends bitwise where it ends without them: with equal counts, where every
    check runs, and with uneven ones, where the checks after a rank ran out fail and are caught, the loop going on
    (the joined rank shadowed each probe round, and waits for the others' next round again)."""
    rank = dist.get_rank()
    steps = counts[rank]
    finals = []
    for checks in (True, False):
        model = make_model(seed=rank)
        opt = DistributedOptimizer(OPTIMIZERS["momentum"](model.parameters()), pack_threshold=64, stall_timeout=10,
                                   compression=_compressor(compression))

        def train_step(t):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            if checks and t < min(counts):  # the gradients are views of the packs' buffers: the probe must not touch them
                opt.check_drift()
            opt.step()

        outcome = checks_at_the_top(opt, steps, train_step, every=1 if checks else None, go_on=True)
        finals.append(([p.detach().clone() for p in model.parameters()], outcome))
        opt.close()
    (with_checks, outcome), (without, _) = finals
    return dict(outcome, bitwise=all(torch.equal(a, b) for a, b in zip(with_checks, without)))


def add_param_group_inside_the_block(counts, add_at):
    """``add_param_group()`` at the top of step ``add_at`` inside the block, on every rank that still has data:
    its check and broadcast must not meet the shadow round of a rank that ran out (at ``add_at``: just now, so
    that no round has told the others yet)."""
    rank = dist.get_rank()
    model, head = make_model(seed=rank), nn.Linear(2, 2).double()
    opt = DistributedOptimizer(OPTIMIZERS["momentum"](model.parameters()), pack_threshold=64, stall_timeout=10)
    error, start = None, time.monotonic()
    try:
        with opt.join():
            for t in range(counts[rank]):
                if t == add_at:
                    opt.add_param_group({"params": list(head.parameters())})
                opt.zero_grad()
                x, y = batch(rank, t)
                out = model(x)
                if t >= add_at:
                    out = head(out)
                nn.functional.mse_loss(out, y).backward()
                opt.step()
    except RuntimeError as exc:
        error = str(exc)
    result = {"error": error, "seconds": time.monotonic() - start, "groups": len(opt.param_groups),
              "params": [p.detach().clone() for p in [*model.parameters(), *head.parameters()]]}
    opt.close()
    return result


CASES = {
    # rank r gets 10 + r batches
    "sgd staircase": (2, train_uneven, ([10, 11], "sgd"), {}),
    "momentum staircase": (3, train_uneven, ([10, 11, 12], "momentum"), {}),
    "adam staircase": (3, train_uneven, ([10, 11, 12], "adam"), {}),
    "adam staircase, world 2": (2, train_uneven, ([10, 11], "adam"), {}),
    # the root finishes first, a middle rank last, a rank with no data at all
    "root first": (3, train_uneven, ([4, 9, 6], "momentum"), {}),
    "root first, world 2": (2, train_uneven, ([3, 7], "adam"), {}),
    "a rank without data": (3, train_uneven, ([5, 0, 3], "momentum"), {}),
    "equal counts": (2, train_uneven, ([5, 5], "adam"), {}),
    "accumulation": (3, train_uneven, ([6, 4, 5], "adam"), {"passes": 3}),
    "no_sync": (2, train_uneven, ([6, 4], "momentum"), {"no_sync_first": True}),
    "one pack per gradient": (2, train_uneven, ([4, 7], "momentum"), {"threshold": 0}),
    "divide by world": (3, train_uneven, ([7, 3, 5], "momentum"), {"divide_by_world": True}),
    "bcast_period": (3, train_uneven, ([7, 3, 5], "adam"), {"bcast_period": 2}),
    # the round is sent again for the unfrozen layer; the others' gradients must not be rescaled twice
    "unfreeze after a rank joined": (2, train_uneven, ([5, 2], "momentum"), {"unfreeze_at": 3}),
    "unfreeze after a rank joined, divide by world": (3, train_uneven, ([6, 2, 4], "momentum"),
                                                     {"unfreeze_at": 3, "divide_by_world": True}),
    "compression": (2, train_uneven, ([6, 9], "momentum"), {"compression": "bf16"}),
    "lbfgs": (2, train_lbfgs_uneven, ([3, 5],), {}),
    # once a rank has joined, the closure's loss is the mean over the ranks still training
    "lbfgs, world 3": (3, lbfgs_against_a_single_process, ([2, 5, 4],), {}),
    "lbfgs strong wolfe, world 3": (3, lbfgs_against_a_single_process, ([4, 1, 5],), {"line_search": "strong_wolfe"}),
    # issue 46's case: one rank stops after its first step, two train on (float32 differed by rounding only)
    "lbfgs, world 3, one rank short": (3, lbfgs_against_a_single_process, ([5, 5, 1],), {}),
    # At two ranks the mean's scalings (1/2, then 2 once one rank has joined) are exact, and so is
    # a float32 run: bitwise the single process's.
    "lbfgs float32, world 2": (2, lbfgs_against_a_single_process, ([5, 1],), {"dtype": torch.float32}),
    "join on one rank only": (2, join_on_some_ranks_only, (), {}),
    "a rank leaves without a block": (2, leave_without_a_block_while_another_rank_joins, (), {}),
    "two optimizers": (3, two_optimizers_uneven, ([4, 6, 2],), {}),
    "nested blocks": (2, nested_blocks, (), {}),
    "two tables overflowing after a rank joined": (2, two_tables_overflowing_after_a_rank_joined, (), {}),
    "horovod join": (3, horovod_join_uneven, ([5, 3, 7],), {}),
    "horovod join, root last": (2, horovod_join_uneven, ([6, 2],), {}),
    "check_drift at the top, a rank just out of data": (2, check_drift_at_the_top, ([5, 3],), {}),
    "check_drift at the top, a rank just out of data, world 3": (3, check_drift_at_the_top, ([6, 3, 6],), {}),
    "check_drift at the top, two optimizers": (2, check_drift_at_the_top, ([4, 2],), {"two": True}),
    "check_drift changes nothing": (2, check_drift_changes_nothing, ([4, 4],), {}),
    "check_drift changes nothing, powersgd": (2, check_drift_changes_nothing, ([4, 4],), {"compression": "powersgd"}),
    "check_drift changes nothing, caught after a rank ran out": (2, check_drift_changes_nothing, ([6, 3],), {}),
    "add_param_group, a rank out of data since a round": (2, add_param_group_inside_the_block, ([5, 2], 3), {}),
    "add_param_group, a rank just out of data": (2, add_param_group_inside_the_block, ([5, 2], 2), {}),
    "add_param_group, every rank training": (2, add_param_group_inside_the_block, ([4, 4], 2), {}),
}

WORLDS = Worlds(CASES, timeout=240)
results = WORLDS.results


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[1] is train_uneven and n != "compression"])
def test_uneven_batches_train_like_a_single_process_averaging_the_ranks_present(name):
    counts = CASES[name][2][0]
    for rank_result in results(name):
        assert rank_result["identical"], rank_result
        assert rank_result["diff"] < TOL, rank_result
        # the step count of the rank that ran longest, everywhere
        assert rank_result["steps"] == max(counts)


def test_compressed_uneven_training_ends_identical_and_close_to_the_exact_average():
    for rank_result in results("compression"):
        assert rank_result["identical"], rank_result
        assert rank_result["diff"] < 2e-2, rank_result


def test_lbfgs_closures_with_uneven_batches_end_with_identical_parameters():
    assert all(results("lbfgs"))


@pytest.mark.parametrize("name", ["lbfgs, world 3", "lbfgs strong wolfe, world 3", "lbfgs, world 3, one rank short",
                                  "lbfgs float32, world 2"])
def test_lbfgs_after_a_rank_joined_averages_the_closures_loss_over_the_ranks_training(name):
    counts = CASES[name][2][0]
    for rank, r in enumerate(results(name)):
        assert r["identical"], r
        assert r["diff"] < TOL, r
        # step(closure) returns the loss of the ranks still training, the same on each of them
        assert r["losses"] == counts[rank] and r["loss_diff"] < TOL, r


def test_a_join_block_on_some_ranks_only_fails_on_every_rank_naming_the_fix():
    outcomes = results("join on one rank only")
    assert all(o[0] == "error" for o in outcomes), outcomes
    assert len({o[1] for o in outcomes}) == 1
    assert "1 of 2 ranks are inside a join block of this optimizer and the others are not (they are outside any " \
           "block, or in a block over other optimizers): every rank must enter the same join block" in outcomes[0][1]


def test_a_rank_inside_a_block_is_told_that_the_rank_that_left_was_not_in_one_rather_than_to_enter_one():
    inside, left = results("a rank leaves without a block")
    assert left == ("left",)
    assert inside[0] == "error", inside
    assert "rank 1 closed its DistributedOptimizer" in inside[1], inside[1]
    assert inside[1].endswith("This rank is inside a join block of this optimizer and rank 1 was not when it left: "
                              "every rank must enter the same join block, with the same optimizers (`with "
                              "opt.join():`, or `with distopt.join(opt1, opt2):` for several), around the same "
                              "training loop, a rank without data too"), inside[1]


def test_two_optimizers_of_one_loop_join_together_end_identical_and_train_like_one_process():
    for identical, diff in results("two optimizers"):
        assert identical and diff < 1e-12, diff


def test_a_joined_rank_does_not_wait_on_one_optimizers_overflow_while_the_other_waits_on_anothers():
    for result in results("two tables overflowing after a rank joined"):
        assert result["diff"] < TOL, result
        assert result["gathered"] == [True, True], result  # the tables' rows travel again after the overflow
        # Waiting for one table's dense all-reduce could wait for the other's on the other rank,
        # until the end-of-backward patience (20 s here) let go; the step takes 0.2 s of sleep.
        assert result["slowest"] < 10, result


def test_nested_join_blocks_are_refused_with_the_fix():
    for text in results("nested blocks"):
        assert "join blocks cannot be nested" in text and "distopt.join(opt1, opt2)" in text


@pytest.mark.parametrize("name, last", [("horovod join", 2), ("horovod join, root last", 0)])
def test_horovod_join_counts_joined_ranks_as_zeros_and_returns_the_last_rank(name, last):
    for rank_result in results(name):
        assert rank_result["identical"], rank_result
        assert rank_result["diff"] < TOL, rank_result
        assert rank_result["last"] == last


JOINED_BEFORE_CHECK = ("check_drift() was called inside a join block after a rank ran out of data: that rank cannot "
                       "take part; call it after the block, where every rank holds the same state again")


@pytest.mark.parametrize("name", ["check_drift at the top, a rank just out of data",
                                  "check_drift at the top, a rank just out of data, world 3",
                                  "check_drift at the top, two optimizers"])
def test_check_drift_at_the_top_of_the_loop_after_a_rank_ran_out_raises_at_once_on_every_training_rank(name):
    # Its all-gather met the joined rank's shadow round: every rank waited for the stall timeout (30 minutes by
    # default; 10 s here). Now a probe round that the joined rank shadows tells the others first.
    counts = CASES[name][2][0]
    last = min(counts)
    for rank, r in enumerate(results(name)):
        assert r["seconds"] < 8, r
        if counts[rank] > last:  # still training: the checks before the rank ran out ran, then the same error
            assert r["checks"] == last and r["error"] == JOINED_BEFORE_CHECK, r
        else:  # the joined rank: its shadow round lost the peers, and it says why they left
            assert r["checks"] == last, r
            assert "is gone: it exited while it waited for the other ranks in check_drift() inside a join block" \
                in r["error"] and JOINED_BEFORE_CHECK in r["error"], r


@pytest.mark.parametrize("name", ["check_drift changes nothing", "check_drift changes nothing, powersgd"])
def test_check_drift_inside_a_join_block_where_no_rank_has_joined_changes_no_parameter(name):
    for r in results(name):
        assert r["error"] is None and r["checks"] == 4, r
        assert r["bitwise"], r


def test_a_check_drift_error_caught_inside_the_block_lets_training_go_on_as_without_the_checks():
    trainer, joined = results("check_drift changes nothing, caught after a rank ran out")
    assert trainer["checks"] == 3 and trainer["errors"] == 3 and trainer["error"] == JOINED_BEFORE_CHECK, trainer
    assert joined["checks"] == 3 and joined["errors"] == 0, joined
    assert trainer["bitwise"] and joined["bitwise"], (trainer, joined)


JOINED_BEFORE_ADD = "add_param_group() was called inside a join block after a rank ran out of data"


@pytest.mark.parametrize("name", ["add_param_group, a rank out of data since a round",
                                  "add_param_group, a rank just out of data"])
def test_add_param_group_inside_a_join_block_after_a_rank_ran_out_raises_at_once_and_adds_nothing(name):
    # Its check and broadcast met the joined rank's shadow round: every rank waited for the stall timeout (30
    # minutes by default; 10 s here). Now the round's flags, or a probe round the joined rank shadows, say so first.
    trainer, joined = results(name)
    assert trainer["seconds"] < 8 and trainer["error"].startswith(JOINED_BEFORE_ADD), trainer
    assert trainer["groups"] == 1, trainer
    assert "is gone: it exited while it waited for the other ranks in add_param_group() inside a join block" \
        in joined["error"] and JOINED_BEFORE_ADD in joined["error"], joined


def test_add_param_group_inside_a_join_block_where_every_rank_trains_adds_the_group_on_every_rank():
    first, second = results("add_param_group, every rank training")
    assert first["error"] is None and second["error"] is None, (first, second)
    assert first["groups"] == second["groups"] == 2
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))
