"""Every rank agrees or fails loudly: what happens when one rank's settings, model, data or timing differ.

Each case either trains like single-process training on the global batch, or
raises the same clear error on every rank within seconds. Never a hang, an
abort, or ranks that drift apart. The checks of one world run in one launch.
"""
import random
import re
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import DistributedOptimizer
from distopt._testing import run_world

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(300)]

BATCH = 12
TOL = 1e-10


def rank_world():
    return dist.get_rank(), dist.get_world_size()


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def data(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 4, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def shard(t):
    rank, world = rank_world()
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def identical_on_all_ranks(tensors):
    mine = [t.detach().clone() for t in tensors]
    return all(all(torch.equal(a, b) for a, b in zip(mine, other)) for other in distopt.all_gather_object(mine))


def outcome(fn):
    """``("ok", value)`` or ``("error", type name, message)``: what a rank saw."""
    try:
        return ("ok", fn())
    except Exception as exc:  # the point is to compare errors across ranks
        return ("error", type(exc).__name__, str(exc), traceback.format_exc())


def built(opt):
    opt.close()
    return "built"


def same_error_everywhere(outcomes, error, pattern):
    import re

    assert all(o[0] == "error" for o in outcomes), outcomes
    assert len({o[2] for o in outcomes}) == 1, [o[2] for o in outcomes]
    assert outcomes[0][1] == error, outcomes[0]
    assert re.search(pattern, outcomes[0][2]), outcomes[0][2]


# ---------------------------------------------------------------------- 1, 2: order, names and settings


def _named_in_rank_order(swap):
    """Two same-shaped layers listed in the other order on rank 1 when ``swap``."""
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    names = ["a", "b"] if not (swap and dist.get_rank() == 1) else ["b", "a"]
    named = [(f"{n}.{k}", p) for n in names for k, p in model[n].named_parameters()]
    return model, named


def order_worker():
    model, named = _named_in_rank_order(swap=True)
    return outcome(lambda: built(DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                                      named_parameters=named)))


def names_worker(variant):
    """Rank 1 passes no names ("one_rank") or names with DDP's "module." prefix ("prefix")."""
    rank, _ = rank_world()
    model = make_model()
    named = list(model.named_parameters())
    if rank == 1 and variant == "prefix":
        named = [(f"module.{n}", p) for n, p in named]
    kwargs = {} if rank == 1 and variant == "one_rank" else {"named_parameters": named}
    return outcome(lambda: built(DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)))


def layout_worker():
    """Rank 1 alone converts a conv net to channels_last: a 1.2 MiB weight is sent where it lies on one rank only."""
    torch.manual_seed(0)
    model = nn.Conv2d(256, 320, 2).double()
    if dist.get_rank() == 1:
        model = model.to(memory_format=torch.channels_last)
    return outcome(lambda: built(DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                      pack_threshold=1 << 20)))


SETTINGS = {
    "pack_threshold": (1024, 2048),
    "compression": (None, "bf16"),
    "bcast_period": (0, 3),
    "reduce_op": ("mean", "sum"),
    "backward_passes_per_step": (1, 2),
    "sparse_as_dense": (False, True),
    "root_rank": (0, 1),
    "check_every": (100, 50),
    "drift_atol": (0.0, 1e-06),
    "drift_rtol": (0.0, 0.5),
    "on_drift": ("raise", "warn"),
}


def settings_worker(key):
    values = SETTINGS[key]
    value = values[min(dist.get_rank(), 1)]
    model = make_model()
    return outcome(lambda: built(DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **{key: value})))


def share_worker():
    """One rank shards with the share finished in step(), the other in the background."""
    share = ("in_step", "background")[min(dist.get_rank(), 1)]
    model = make_model()
    return outcome(lambda: built(DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                      mode=distopt.ShardedState(share=share))))


def randomized_variations_worker(seed):
    """Per-rank variations of settings, parameter order and names, drawn from one seed per case."""
    rank, world = rank_world()
    rng = random.Random(seed)
    rank_that_differs = rng.randrange(world)
    what = rng.choice(["nothing", "order", "name", "setting"])
    key = rng.choice(sorted(SETTINGS))
    model = make_model()
    named = list(model.named_parameters())
    differs = rank == rank_that_differs
    if what == "order" and differs:
        named[0], named[2] = named[2], named[0]  # same shapes? no: a shape error, also a clear one
    if what == "name" and differs:
        named = [("renamed." + n if i == 1 else n, p) for i, (n, p) in enumerate(named)]
    kwargs = {"pack_threshold": rng.choice([0, 64, 1 << 20])}
    if what == "setting" and differs:
        kwargs[key] = SETTINGS[key][1]
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)

    def train():
        opt = DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9),
                                   named_parameters=named, **kwargs)
        for x, y in data(3, seed=seed):
            ref_opt.zero_grad()
            loss_of(ref, x, y).backward()
            ref_opt.step()
            opt.zero_grad()
            loss_of(model, shard(x), shard(y)).backward()
            opt.step()
        opt.close()
        return max_diff(model.parameters(), ref.parameters()), identical_on_all_ranks(model.parameters())

    return what, outcome(train)


# ---------------------------------------------------------------------- 3: a backward that touches nothing


def _skip_step(model, x, y, skip):
    if skip:
        # A skipped batch replaced by a constant loss: backward runs, but reaches no parameter.
        return torch.zeros((), dtype=torch.float64, requires_grad=True)
    return loss_of(model, shard(x), shard(y))


def skipped_batch_worker(call_synchronize, clip):
    rank, world = rank_world()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    # The end of backward waits 3 s (the default minute, shortened), however slow earlier rounds were.
    opt._engine.backward_patience, opt._engine.patience_growth = 3.0, 0.0

    def train():
        for step, (x, y) in enumerate(data(4)):
            opt.zero_grad()
            _skip_step(model, x, y, skip=(step == 2 and rank == 1)).backward()
            if call_synchronize:
                opt.synchronize()
            metric = torch.tensor([float(step)])
            distopt.all_reduce(metric)  # the user's own collective between backward and step never hangs
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        return identical_on_all_ranks(model.parameters())

    return outcome(train)


def straggler_worker(clip):
    """Rank 1 arrives 4 s late at one step; the other ranks give up waiting after 1.5 s and go on."""
    rank, world = rank_world()
    model, ref = make_model(), make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    # Exactly 1.5 s, however slow earlier rounds were (by default the wait grows to 20 times the slowest
    # one): rank 1's 4 s are late by 2.5 s whatever the machine's load.
    opt._engine.backward_patience, opt._engine.patience_growth = 1.5, 0.0
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def train():
        packs = []
        for step, (x, y) in enumerate(data(2 if clip else 3)):  # with clip, rank 0 stops at step 1
            ref_opt.zero_grad()
            loss_of(ref, x, y).backward()
            ref_opt.step()
            if step == 1 and rank == 1:
                time.sleep(4)
            opt.zero_grad()
            loss_of(model, shard(x), shard(y)).backward()
            if clip == "reassign" and step == 1:  # new tensors, not a change in place
                for p in model.parameters():
                    p.grad = p.grad.clamp(-0.05, 0.05)
            elif clip and step == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            packs.append(opt.stats.packs)
        if clip:
            return packs
        return max_diff(model.parameters(), ref.parameters()), identical_on_all_ranks(model.parameters()), packs

    return outcome(train)


# ---------------------------------------------------------------------- 4: frozen parameters


def frozen_worker(reduce_op="mean"):
    """Train the head, unfreeze the backbone at step 3, freeze it again at step 6: like one process.

    With ``reduce_op="sum"`` the reference steps on the sum of the ranks' gradients.
    """
    rank, world = rank_world()
    model = make_model(seed=rank)  # different starts: construction aligns every parameter, frozen ones too
    ref = make_model(seed=0)
    backbone = list(model[0].parameters())
    ref_backbone = list(ref[0].parameters())
    for p in backbone + ref_backbone:
        p.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pack_threshold=64,
                               reduce_op=reduce_op)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    start_identical = identical_on_all_ranks(model.parameters())
    for step, (x, y) in enumerate(data(8)):
        if step in (3, 6):
            for p in backbone + ref_backbone:
                p.requires_grad_(step == 3)
        ref_opt.zero_grad()
        (loss_of(ref, x, y) * (world if reduce_op == "sum" else 1)).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_of(model, shard(x), shard(y)).backward()
        opt.step()
    return start_identical, max_diff(model.parameters(), ref.parameters()), identical_on_all_ranks(model.parameters())


def unfreeze_differently_worker():
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    def train():
        for step, (x, y) in enumerate(data(3)):
            if step == 1 and dist.get_rank() == 0:
                model[0].weight.requires_grad_(True)
            opt.zero_grad()
            loss_of(model, shard(x), shard(y)).backward()
            opt.step()

    return outcome(train)


# ---------------------------------------------------------------------- 5, 6, 7: the model or the wrapper changes


def converted_model_worker():
    model = nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    model.double()

    def train():
        opt.zero_grad()
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()

    return outcome(train)


def second_wrapper_worker():
    """Switching optimizers mid-training: the new wrapper takes over; each gradient is reduced once."""
    rank, world = rank_world()
    model, ref = make_model(), make_model()
    old = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    batches = data(4)
    for x, y in batches[:2]:
        for m, o, xs, ys in ((ref, ref_opt, x, y), (model, old, shard(x), shard(y))):
            o.zero_grad()
            loss_of(m, xs, ys).backward()
            o.step()
    new = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))  # `opt = ...` while `opt` still lives
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    packs_sent = []
    for x, y in batches[2:]:
        for m, o, xs, ys in ((ref, ref_opt, x, y), (model, new, shard(x), shard(y))):
            o.zero_grad()
            loss_of(m, xs, ys).backward()
            o.step()
        packs_sent.append(new.stats.packs)
    stepping_old = outcome(old.step)
    # The old wrapper's hooks are gone: only the new one sends, each of its packs once a step.
    once = old._engine.handles == [] and packs_sent == [len(new._engine.packs)] * 2
    return max_diff(model.parameters(), ref.parameters()), once, stepping_old


def create_graph_worker():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def train():
        opt.zero_grad()
        loss_of(model, *[shard(t) for t in data(1)[0]]).backward(create_graph=True)
        opt.step()

    return outcome(train)


def ddp_worker():
    """The likeliest slip in a move from DDP: the model is still wrapped in DistributedDataParallel."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = DistributedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))

    def train():
        loss_of(ddp, *[shard(t) for t in data(1)[0]]).backward()

    try:
        return outcome(train)
    finally:
        opt.close()


def ddp_elsewhere_worker():
    """DDP over another model is no concern; the wrapper's global forward hook is gone after its first step."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    model, critic = make_model(), make_model(seed=1)
    critic_ddp = nn.parallel.DistributedDataParallel(critic)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    watching = len(hooks) - before

    def train():
        x, y = [shard(t) for t in data(1)[0]]
        (loss_of(model, x, y) + loss_of(critic_ddp, x, y)).backward()
        opt.step()
        return watching, len(hooks) - before

    try:
        return outcome(train)
    finally:
        opt.close()


# ---------------------------------------------------------------------- 8: arguments and helpers


def fsdp2_worker():
    """A model sharded by FSDP2's fully_shard (DTensor parameters), at construction and in add_param_group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = make_model()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    made = outcome(lambda: built(DistributedOptimizer(torch.optim.SGD(sharded.parameters(), lr=0.1),
                                                      named_parameters=sharded.named_parameters())))
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    added = outcome(lambda: opt.add_param_group({"params": list(sharded.parameters())[2:]}))
    groups = len(opt.param_groups)
    # The refusals ran no collective on any rank, so the ranks still pair: a step trains alike.
    x, y = data(1)[0]
    opt.zero_grad()
    loss_of(model, shard(x), shard(y)).backward()
    opt.step()
    identical = identical_on_all_ranks(list(model.parameters()))
    opt.close()
    return made, added, groups, identical


def outside_group_worker():
    group = dist.new_group([0, 1])  # every rank creates it; rank 2 is not in it
    model = make_model()
    made = outcome(lambda: built(DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                      process_group=group)))
    waited = outcome(lambda: distopt.barrier(group))
    return dist.get_rank(), made, waited


def int16_worker():
    rank, world = rank_world()
    x = torch.tensor([rank + 1, 30000 - rank], dtype=torch.int16)
    reduced = distopt.all_reduce(x.clone(), op="max")
    sent = distopt.broadcast(torch.tensor([rank * 7], dtype=torch.int16), src=world - 1)
    gathered = distopt.all_gather(torch.full((rank + 1,), rank, dtype=torch.int16))
    return reduced.tolist(), reduced.dtype, sent.tolist(), [(g.dtype, g.tolist()) for g in gathered]


def threshold_types_worker():
    model = make_model()
    opts = [DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pack_threshold=t)
            for t in (1e6, np.int64(1024))]
    return [o.pack_threshold for o in opts]


# ---------------------------------------------------------------------- steps, and gradients set around them


def extra_step_worker(who, reduce_op="mean"):
    """``who`` calls step() a second time for batch 1: "all" (as one process may), or rank 1 only."""
    rank, world = rank_world()
    model, reference = make_model(), make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), reduce_op=reduce_op)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scale = world if reduce_op == "sum" else 1  # summed gradients are those of the summed losses

    def train():
        for step, (x, y) in enumerate(data(4)):
            ref_opt.zero_grad()
            (loss_of(reference, x, y) * scale).backward()
            ref_opt.step()
            opt.zero_grad()
            loss_of(model, shard(x), shard(y)).backward()
            opt.step()
            if step == 1 and who == "all":
                ref_opt.step()
            if step == 1 and (who == "all" or rank == 1):
                opt.step()  # the same gradients again: nothing is sent a second time
        return max_diff(model.parameters(), reference.parameters())

    return outcome(train)


def synchronize_after_step_worker():
    """Rank 0 alone calls synchronize() after every step (to log a gradient norm, say)."""
    rank, _ = rank_world()
    model, reference = make_model(), make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def train():
        for x, y in data(4):
            ref_opt.zero_grad()
            loss_of(reference, x, y).backward()
            ref_opt.step()
            opt.zero_grad()
            loss_of(model, shard(x), shard(y)).backward()
            opt.step()
            if rank == 0:
                opt.synchronize()  # a no-op: the gradients are averaged already
        return max_diff(model.parameters(), reference.parameters()), identical_on_all_ranks(model.parameters())

    return outcome(train)


def skipped_step_model_zero_grad_worker():
    """GradScaler skips the step of an overflowing batch, and the loop clears gradients through the model."""
    model, reference = make_model().float(), make_model().float()

    def run(net, opt, batches):
        scaler = torch.amp.GradScaler("cpu")
        for i, (x, y) in enumerate(batches):
            net.zero_grad()  # not opt.zero_grad(): the wrapper sees the gradients go
            loss = loss_of(net, x.float(), y.float()) * (1e38 if i == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    def train():
        batches = data(4)
        run(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
        run(model, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
            [(shard(x), shard(y)) for x, y in batches])
        return max_diff(model.parameters(), reference.parameters())

    return outcome(train)


def hand_set_frozen_worker(who):
    """Gradients from torch.func, set by hand on parameters that do not require grad, on ``who`` ranks."""
    from torch.func import functional_call, grad

    rank, _ = rank_world()
    model, reference = make_model(), make_model()
    for p in list(model.parameters()) + list(reference.parameters()):
        p.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def grads(net, x, y):
        return grad(lambda ps: loss_of(lambda t: functional_call(net, ps, (t,)), x, y))(dict(net.named_parameters()))

    def train():
        for x, y in data(3):
            for p, g in zip(reference.parameters(), grads(reference, x, y).values()):
                p.grad = g
            ref_opt.step()
            if who == "all" or rank == 0:
                for p, g in zip(model.parameters(), grads(model, shard(x), shard(y)).values()):
                    p.grad = g
            opt.step()
        return max_diff(model.parameters(), reference.parameters()), identical_on_all_ranks(model.parameters())

    return outcome(train)


# ---------------------------------------------------------------------- one launch per world


def world2_checks():
    results = {
        "order": order_worker(),
        "names_one_rank": names_worker("one_rank"),
        "names_prefix": names_worker("prefix"),
        "layout": layout_worker(),
        "settings": {key: settings_worker(key) for key in SETTINGS},
        "share": share_worker(),
        "skip_clip": skipped_batch_worker(call_synchronize=False, clip=True),
        "skip_sync_clip": skipped_batch_worker(call_synchronize=True, clip=True),
        "frozen": frozen_worker(),
        "frozen_sum": frozen_worker("sum"),
        "unfreeze_differently": unfreeze_differently_worker(),
        "converted": converted_model_worker(),
        "second": second_wrapper_worker(),
        "create_graph": create_graph_worker(),
        "ddp": ddp_worker(),
        "ddp_elsewhere": ddp_elsewhere_worker(),
        "fsdp2": fsdp2_worker(),
        "int16": int16_worker(),
        "threshold_types": threshold_types_worker(),
        "extra_step_all": extra_step_worker("all"),
        "extra_step_all_sum": extra_step_worker("all", "sum"),
        "extra_step_one": extra_step_worker("one"),
        "synchronize_after_step": synchronize_after_step_worker(),
        "skipped_step_model_zero_grad": skipped_step_model_zero_grad_worker(),
        "hand_set_frozen": hand_set_frozen_worker("all"),
        "hand_set_frozen_one": hand_set_frozen_worker("one"),
        # last: rank 0 raises once the round is back, rank 1 goes on to the end of its loop alone
        "straggler_clip": straggler_worker(clip=True),
        "straggler_reassign": straggler_worker(clip="reassign"),
    }
    return results


_RESULTS = {}


def results(world):
    if not _RESULTS:
        # Both worlds at once, on first use: world 3's checks fill the seconds world 2's stragglers sleep.
        with ThreadPoolExecutor(2) as pool:
            _RESULTS.update({size: pool.submit(run_world, fn, size, timeout=240)
                             for size, fn in ((2, world2_checks), (3, world3_checks))})
    return _RESULTS[world].result()


def world3_checks():
    return {
        "outside": outside_group_worker(),
        "randomized": [randomized_variations_worker(seed) for seed in range(12)],
        "skip_nothing_touched": skipped_batch_worker(call_synchronize=False, clip=False),
        "frozen": frozen_worker(),
        "int16": int16_worker(),
        # Here rather than in world 2, whose stragglers' sleeps make it the longer launch: ranks 0 and 2 give up.
        "straggler": straggler_worker(clip=False),
    }


def test_same_shapes_in_a_different_order_fail_on_every_rank_naming_both():
    same_error_everywhere([r["order"] for r in results(2)], "ValueError",
                          r"parameter 0 is 'a.weight' on rank 0 but 'b.weight' on rank 1.*same order on every rank")


@pytest.mark.parametrize("key", sorted(SETTINGS))
def test_a_setting_that_differs_between_ranks_fails_on_every_rank_with_each_value(key):
    a, b = SETTINGS[key]
    if key == "compression":  # a compressor is compared (and shown) by its settings
        b = {"compressor": "Cast", "dtype": "torch.bfloat16"}
    same_error_everywhere([r["settings"][key] for r in results(2)], "ValueError",
                          rf"different {key} on different ranks \(rank 0: {re.escape(repr(a))}, "
                          rf"rank 1: {re.escape(repr(b))}\)")


def test_a_sharded_share_that_differs_between_ranks_fails_on_every_rank_naming_it():
    same_error_everywhere([r["share"] for r in results(2)], "ValueError",
                          r"different shard_state_share on different ranks \(rank 0: 'in_step', "
                          r"rank 1: 'background'\)")


def test_randomized_per_rank_variations_train_alike_or_fail_alike():
    per_rank = [r["randomized"] for r in results(3)]
    for case in range(len(per_rank[0])):
        whats = {rank[case][0] for rank in per_rank}
        outcomes = [rank[case][1] for rank in per_rank]
        (what,) = whats
        if what == "nothing":
            for o in outcomes:
                assert o[0] == "ok", o
                diff, identical = o[1]
                assert diff < TOL and identical, (case, o)
        else:
            assert all(o[0] == "error" for o in outcomes), (case, what, outcomes)
            assert len({o[2] for o in outcomes}) == 1, (case, what, [o[2] for o in outcomes])


def test_a_skipped_batch_with_clipping_fails_on_every_rank_naming_synchronize():
    same_error_everywhere([r["skip_clip"] for r in results(2)], "RuntimeError",
                          r"different points.*Call opt.synchronize\(\) right after backward\(\)")


def test_a_skipped_batch_trains_identically_when_synchronize_is_called():
    for o in [r["skip_sync_clip"] for r in results(2)]:
        assert o == ("ok", True), o


def test_a_straggler_past_the_patience_still_trains_like_one_process():
    for o in [r["straggler"] for r in results(3)]:
        assert o[0] == "ok", o
        diff, identical, packs = o[1]
        assert diff < TOL and identical and packs == [1, 1, 1], o


@pytest.mark.parametrize("check", ["straggler_clip", "straggler_reassign"])
def test_gradients_changed_before_the_straggler_arrived_are_an_error(check):
    rank0, rank1 = [r[check] for r in results(2)]
    assert rank0[0] == "error" and rank0[1] == "RuntimeError", rank0
    assert "gradients were changed (clipped, unscaled, ...) after backward() returned but before" in rank0[2]
    assert "Call opt.synchronize() after backward() and before touching gradients" in rank0[2]
    assert rank1[0] == "ok", rank1  # its gradients were complete when it clipped them


def test_a_skipped_batch_without_synchronize_fails_alike_at_world_3():
    same_error_everywhere([r["skip_nothing_touched"] for r in results(3)], "RuntimeError", r"synchronize\(\)")


@pytest.mark.parametrize("world, check", [(2, "frozen"), (3, "frozen"), (2, "frozen_sum")])
def test_frozen_parameters_start_identical_and_unfreezing_trains_like_one_process(world, check):
    for start_identical, diff, identical in [r[check] for r in results(world)]:
        assert start_identical and identical
        assert diff < TOL, diff


def test_unfreezing_on_one_rank_only_fails_on_every_rank():
    same_error_everywhere([r["unfreeze_differently"] for r in results(2)], "ValueError",
                          r"different ranks made different frozen parameters trainable.*"
                          r"rank 0: \{'param_groups\[0\]\[0\]': 'trainable'\}; rank 1: \{\}")


def test_a_model_converted_after_wrapping_says_what_happened_and_what_to_do():
    same_error_everywhere([r["converted"] for r in results(2)], "RuntimeError",
                          r"parameter '(weight|bias)' is now torch.float64 on cpu, but it was torch.float32.*convert the "
                          r"model first")


def test_the_newest_wrapper_takes_over_and_each_gradient_is_reduced_once():
    for diff, once, stepping_old in [r["second"] for r in results(2)]:
        assert diff < TOL, diff
        assert once
        assert stepping_old[0] == "error" and "no longer reduces" in stepping_old[2]


def test_a_model_still_wrapped_in_ddp_is_refused_at_its_first_forward_on_every_rank_saying_what_to_remove():
    same_error_everywhere([r["ddp"] for r in results(2)], "RuntimeError", re.escape(
        "this model is wrapped in DistributedDataParallel, and a DistributedOptimizer averages the gradients of "
        "the same parameters ('0.weight', '0.bias', '2.weight' and 3 more): each gradient would be averaged twice, "
        "and DDP's result, written last, is divided by the world size once more (with gradient_as_bucket_view=True "
        "DDP fails instead). Remove the DDP wrapper and call the model itself (e.g. `model = ddp_model.module`)"))


def test_ddp_over_other_parameters_trains_and_the_forward_hook_goes_at_the_first_step():
    for status, value in [r["ddp_elsewhere"][:2] for r in results(2)]:
        assert status == "ok", value
        assert value == (1, 0)  # watching until the first step, then nothing left on every module call


def test_fsdp2_dtensor_parameters_are_refused_on_every_rank_before_any_collective_saying_what_to_do():
    fsdp = r"is a DTensor \(placements \(Shard\(dim=0\),\), e.g. from FSDP2's fully_shard.*does not support " \
           r"FSDP2/DTensor parameters yet. Build the wrapper over the plain, unsharded model"
    same_error_everywhere([r["fsdp2"][0] for r in results(2)], "TypeError", r"parameter '0.weight' " + fsdp)
    same_error_everywhere([r["fsdp2"][1] for r in results(2)], "TypeError", r"parameter 'param_groups\[1\]\[0\]' "
                          + fsdp)
    for _, _, groups, identical in [r["fsdp2"] for r in results(2)]:
        assert groups == 1 and identical  # the refused group was not added; the ranks still train alike


def test_create_graph_is_refused_with_what_to_do_instead():
    same_error_everywhere([r["create_graph"] for r in results(2)], "RuntimeError",
                          r"create_graph=True.*torch.autograd.grad")


def test_a_rank_outside_process_group_is_told_it_is_not_a_member():
    for rank, made, waited in [r["outside"] for r in results(3)]:
        if rank == 2:
            for o in (made, waited):
                assert o[0] == "error" and o[1] == "ValueError", o
                assert "this process (global rank 2) is not a member of" in o[2], o
        else:
            assert made[0] == "ok" and waited[0] == "ok", (made, waited)


@pytest.mark.parametrize("world", [2, 3])
def test_int16_tensors_travel_on_gloo(world):
    for reduced, dtype, sent, gathered in [r["int16"] for r in results(world)]:
        assert dtype == torch.int16
        assert reduced == [world, 30000]
        assert sent == [(world - 1) * 7]
        assert gathered == [(torch.int16, [r] * (r + 1)) for r in range(world)]


def test_integral_pack_thresholds_are_accepted():
    for thresholds in [r["threshold_types"] for r in results(2)]:
        assert thresholds == [1_000_000, 1024]


# ---------------------------------------------------------------------- single process: argument checks


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"pack_threshold": 1.5}, ValueError, r"pack_threshold must be a number of bytes >= 0, a whole one.*got 1.5"),
        ({"pack_threshold": "1M"}, ValueError, r"pack_threshold must be a number of bytes.*got '1M'"),
        ({"sparse_as_dense": "no"}, TypeError, r"sparse_as_dense must be True or False, got 'no'"),
        ({"root_rank": True}, ValueError, r"root_rank must be a rank"),
    ],
)
def test_argument_types_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("call", [lambda: distopt.sync_random_seed(group="x"), lambda: distopt.barrier(group=3),
                                  lambda: distopt.all_reduce(torch.ones(1), group="x")])
def test_a_group_that_is_not_a_process_group_is_a_type_error(call):
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup"):
        call()


def test_get_offsets_rejects_negative_sizes():
    with pytest.raises(ValueError, match=r"shapes\[1\] = \(2, -3\) has the size -3"):
        distopt.get_offsets([(1,), (2, -3)])


@pytest.mark.parametrize("check", ["extra_step_all", "extra_step_all_sum"])
def test_a_second_step_on_every_rank_applies_the_same_gradients_again_as_one_process_would(check):
    for o in results(2):
        assert o[check][0] == "ok", o[check]
        assert o[check][1] < TOL


def test_a_second_step_on_one_rank_fails_on_every_rank_at_the_next_round():
    same_error_everywhere([r["extra_step_one"] for r in results(2)], "RuntimeError",
                          r"different numbers of steps.*call step\(\) once per batch, and synchronize\(\) alike, on every rank")


def test_synchronize_after_step_on_one_rank_sends_nothing_and_ranks_stay_identical():
    for o in results(2):
        assert o["synchronize_after_step"][0] == "ok", o["synchronize_after_step"]
        diff, identical = o["synchronize_after_step"][1]
        assert diff < TOL and identical


def test_a_skipped_step_then_model_zero_grad_starts_a_new_round_and_trains_like_one_process():
    for o in results(2):
        assert o["skipped_step_model_zero_grad"][0] == "ok", o["skipped_step_model_zero_grad"]
        assert o["skipped_step_model_zero_grad"][1] < 1e-6  # float32


def test_gradients_set_by_hand_on_frozen_parameters_are_averaged():
    for o in results(2):
        assert o["hand_set_frozen"][0] == "ok", o["hand_set_frozen"]
        diff, identical = o["hand_set_frozen"][1]
        assert diff < TOL and identical


def test_gradients_set_by_hand_on_frozen_parameters_of_one_rank_only_fail_on_every_rank():
    same_error_everywhere([r["hand_set_frozen_one"] for r in results(2)], "ValueError",
                          r"frozen, with a gradient set by hand.*alike on every rank")


@pytest.mark.parametrize("check", ["names_one_rank", "names_prefix"])
def test_names_that_differ_between_ranks_are_reported_as_names_not_as_order(check):
    same_error_everywhere([r[check] for r in results(2)], "ValueError",
                          r"different names on different ranks.*same named_parameters= on every rank")


def test_a_memory_format_that_differs_between_ranks_fails_at_construction_on_every_rank():
    same_error_everywhere([r["layout"] for r in results(2)], "ValueError",
                          r"contiguous on rank 0 but not contiguous \(e.g. channels_last\) on rank 1.*memory format")
