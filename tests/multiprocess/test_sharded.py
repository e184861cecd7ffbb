"""``shard_state=True``: each rank keeps 1/N of the optimizer state, and trains exactly like the unsharded wrapper.

The checks of one world run in one launch; each compares, inside the worker, a
sharded wrapper with an unsharded one on the same data (float64, 1e-10), or a
checkpoint's round trip with an uninterrupted run.
"""
import copy
import re
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import distopt
from distopt import DistributedOptimizer
from distopt._testing import run_world
from distopt.engine import in_flight
from distopt.planning.ownership import assign_owners

from _drift_outcome import checks_at_the_top
from _worlds import Worlds

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(300)]

TOL = 1e-10
STEPS = 20


# ---------------------------------------------------------------------- ownership, without processes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 8))
def test_every_rank_owns_at_most_its_share_plus_the_largest_parameter(sizes, world):
    owners, loads = assign_owners(sizes, world)
    assert len(owners) == len(sizes) and all(0 <= r < world for r in owners)
    for r in range(world):
        assert loads[r] == sum(n for n, o in zip(sizes, owners) if o == r)
        assert loads[r] <= sum(sizes) / world + max(sizes, default=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40).flatmap(lambda s: st.tuples(st.just(s), st.permutations(s))),
       st.integers(1, 8))
def test_every_ranks_share_depends_on_the_sizes_alone_not_on_their_order(sizes_and_shuffled, world):
    sizes, shuffled = sizes_and_shuffled
    assert assign_owners(shuffled, world)[1] == assign_owners(sizes, world)[1]


def test_parameters_added_later_keep_the_earlier_owners():
    owners, loads = assign_owners([40, 10, 30, 20], 2)
    more, _ = assign_owners([25], 2, loads)
    assert owners == [0, 0, 1, 1] and more == [0]


def test_ownership_rejects_bad_input_naming_it():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        assign_owners([1], 0)
    with pytest.raises(ValueError, match="loads has 1 entries for world_size=2"):
        assign_owners([1], 2, [0])


# ---------------------------------------------------------------------- a whole-tensor optimizer


class Lamb(torch.optim.Optimizer):
    """A small LAMB: Adam's direction scaled by a per-tensor trust ratio, which needs the whole tensor."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = state["m"] / (state["v"].sqrt() + group["eps"])
                trust = p.norm() / update.norm().clamp_min(1e-12)
                p.add_(update, alpha=-group["lr"] * float(trust))


class TwiceEvaluated(torch.optim.Optimizer):
    """SGD with momentum whose step evaluates the closure twice (as SAM does), then steps on the second gradients."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                    p.add_(buf.mul_(group["momentum"]).add_(p.grad), alpha=-group["lr"])
        return loss


OPTIMIZERS = {
    "momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "lamb": lambda groups: Lamb(groups, lr=0.01),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 2)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.double()

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def param_groups(model):
    return [
        {"params": list(model.a.parameters()) + list(model.frozen.parameters())},
        {"params": list(model.b.parameters()) + list(model.c.parameters()) + list(model.unused.parameters()),
         "lr": 0.02},
    ]


def batch(step, rank=None):
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)


def train(model, opt, steps, start=0, scheduler=None, clip=True):
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        if not clip:
            pass
        elif getattr(opt.mode, "gradients", False):  # each rank holds its owned gradients only
            opt.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clipping after synchronize()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def state_bytes(states):
    return sum(v.numel() * v.element_size() for state in states for v in state.values() if torch.is_tensor(v))


def parity(name):
    """Sharded and unsharded wrappers over 20 steps: parameters equal, state held 1/N."""
    plain_model, sharded_model = Net(), Net()
    plain = DistributedOptimizer(OPTIMIZERS[name](param_groups(plain_model)), pack_threshold=256)
    sharded = DistributedOptimizer(OPTIMIZERS[name](param_groups(sharded_model)), pack_threshold=256,
                                   shard_state=True)
    sched_a = torch.optim.lr_scheduler.StepLR(plain.optimizer, 5, 0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(sharded.optimizer, 5, 0.5)
    train(plain_model, plain, STEPS, scheduler=sched_a)
    train(sharded_model, sharded, STEPS, scheduler=sched_b)
    diff = max((a - b).abs().max().item() for a, b in zip(plain_model.parameters(), sharded_model.parameters()))
    mine = [p.detach().clone() for p in sharded_model.parameters()]
    identical = all(all(torch.equal(a, b) for a, b in zip(mine, other)) for other in distopt.all_gather_object(mine))
    full, held = state_bytes(plain.optimizer.state.values()), sharded.stats.optimizer_state_bytes
    largest = max(state_bytes([plain.optimizer.state.get(p, {})]) for p in plain_model.parameters())
    plain.close()
    sharded.close()
    return {"diff": diff, "identical": identical, "held": held, "full": full, "largest": largest}


def tensors_of(state_dict):
    return [(k, name, v) for k, st in sorted(state_dict["state"].items()) for name, v in sorted(st.items())
            if torch.is_tensor(v)]


def full_state_dict_and_features(path):
    """Accumulation, no_sync, compression, bcast_period, GradScaler, add_param_group: sharded == unsharded,
    and the gathered state dict equals the unsharded one."""
    models = [Net(), Net()]
    opts = [DistributedOptimizer(torch.optim.Adam(param_groups(m)[:1], lr=0.01), pack_threshold=256,
                                 backward_passes_per_step=2, compression="bf16", bcast_period=3, shard_state=s)
            for m, s in zip(models, (False, True))]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**4) for _ in models]
    for step in range(8):
        if step == 4:  # the second group arrives mid-training, on every rank
            for m, o in zip(models, opts):
                o.add_param_group(param_groups(m)[1])
        x, y = batch(step)
        for m, o, scaler in zip(models, opts, scalers):
            o.zero_grad()
            with o.no_sync():
                scaler.scale(nn.functional.mse_loss(m(x[:3]), y[:3])).backward()
            scaler.scale(nn.functional.mse_loss(m(x[3:]), y[3:])).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(o)
            scaler.update()
    diff = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    plain_sd, sharded_sd = opts[0].state_dict(), opts[1].state_dict()
    same_layout = ([(k, n) for k, n, _ in tensors_of(plain_sd)] == [(k, n) for k, n, _ in tensors_of(sharded_sd)]
                   and plain_sd["param_groups"] == sharded_sd["param_groups"])
    state_diff = max((a - b).abs().max().item() for (_, _, a), (_, _, b) in zip(tensors_of(plain_sd),
                                                                               tensors_of(sharded_sd)))
    merged = distopt.merge_state_dicts(distopt.all_gather_object(opts[1].sharded_state_dict()))
    same_layout = same_layout and [(k, n) for k, n, _ in tensors_of(merged)] == \
        [(k, n) for k, n, _ in tensors_of(sharded_sd)] and merged["param_groups"] == sharded_sd["param_groups"]
    state_diff = max([state_diff] + [(a - b).abs().max().item() for (_, _, a), (_, _, b) in
                                     zip(tensors_of(merged), tensors_of(sharded_sd))])
    if dist.get_rank() == 0:
        torch.save({"model": models[1].state_dict(), "optimizer": sharded_sd}, path)
        torch.save({"model": models[0].state_dict(), "optimizer": plain_sd}, path.replace(".pt", "-plain.pt"))
    dist.barrier()
    for o in opts:
        o.close()
    return {"diff": diff, "same_layout": same_layout, "state_diff": state_diff}


def resume(path, shard_state):
    """Load the checkpoint into a wrapper (sharded or not, any world size) and train 5 more steps."""
    checkpoint = torch.load(path)
    model = Net()
    model.load_state_dict(checkpoint["model"])
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                               shard_state=shard_state)
    opt.load_state_dict(checkpoint["optimizer"])
    held = opt.stats.optimizer_state_bytes
    train(model, opt, 5, start=100)
    out = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return out, held


def resume_both_ways(path):
    """:func:`resume` sharded, then unsharded, then with the gradients sharded too, in one launch."""
    return resume(path, True), resume(path, False), resume(path, "gradients")


def wrap_loaded(path):
    """A checkpoint loaded into the plain optimizer before it is wrapped (where DDP's line was) resumes
    bitwise like one loaded into the wrapper, sharded or not."""
    out = {}
    for shard in (False, True):
        model = Net()
        opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state=shard)
        train(model, opt, 4)
        state, params = opt.state_dict(), copy.deepcopy(model.state_dict())
        opt.close()
        ends = []
        for wrap_first in (True, False):
            model = Net()
            model.load_state_dict(params)
            inner = torch.optim.Adam(param_groups(model), lr=0.01)
            loaded = copy.deepcopy(state)  # Adam's step tensors are taken over as they are, and counted on in place
            if wrap_first:
                opt = DistributedOptimizer(inner, shard_state=shard)
                opt.load_state_dict(loaded)
            else:
                inner.load_state_dict(loaded)
                opt = DistributedOptimizer(inner, shard_state=shard)
            train(model, opt, 4, start=4)
            ends.append([p.detach().clone() for p in model.parameters()])
            opt.close()
        out[shard] = all(torch.equal(a, b) for a, b in zip(*ends))
    return out


def state_dict_on_one_rank():
    model = Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state=True, stall_warning=2.0)
    train(model, opt, 2)
    outcome = None
    if dist.get_rank() == 0:
        try:
            opt.state_dict()
        except RuntimeError as exc:
            outcome = str(exc)
    dist.barrier()  # rank 1 was elsewhere; now both gather, and it works
    complete = len(opt.state_dict()["state"])
    opt.close()
    return outcome, complete


def join_sharded(counts):
    """Uneven batches inside join(), with a per-step LR scheduler: sharded equals unsharded, ranks identical,
    learning rates included; the gradients sharded too (clipped with ``opt.clip_grad_norm_()``, the others with
    ``torch.nn.utils.clip_grad_norm_``) equal unsharded as well."""
    rank = dist.get_rank()
    out = []
    for shard in (False, True, "gradients"):
        model = Net()
        opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                                   shard_state=shard)
        scheduler = torch.optim.lr_scheduler.StepLR(opt.optimizer, 2, 0.5)
        with opt.join():
            train(model, opt, counts[rank], scheduler=scheduler)
        out.append([p.detach().clone() for p in model.parameters()])
        lrs = [group["lr"] for group in opt.optimizer.param_groups]  # a joined rank's scheduler was not advanced
        opt.close()
    diff = max((a - b).abs().max().item() for sharded in out[1:] for a, b in zip(out[0], sharded))
    identical = all(all(torch.equal(a, b) for a, b in zip(sharded, o))
                    for sharded in out[1:] for o in distopt.all_gather_object(sharded))
    return {"diff": diff, "identical": identical and len({tuple(o) for o in distopt.all_gather_object(lrs)}) == 1}


def join_sharded_closure(counts):
    """A closure evaluated twice per step inside join(): sharded (the state, or the gradients too) equals
    unsharded, the returned losses too."""
    rank = dist.get_rank()
    out, losses = [], []
    for shard in (False, True, "gradients"):
        model = Net()
        opt = DistributedOptimizer(TwiceEvaluated(param_groups(model)), pack_threshold=256, shard_state=shard,
                                   stall_timeout=30)  # ranks out of step fail in time
        losses.append([])
        with opt.join():
            for step in range(counts[rank]):
                x, y = batch(step)

                def closure():
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                losses[-1].append(opt.step(closure).item())
        out.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    diff = max((a - b).abs().max().item() for sharded in out[1:] for a, b in zip(out[0], sharded))
    identical = all(all(torch.equal(a, b) for a, b in zip(sharded, o))
                    for sharded in out[1:] for o in distopt.all_gather_object(sharded))
    return {"diff": diff, "identical": identical,
            "loss_diff": max(abs(a - b) for sharded in losses[1:] for a, b in zip(losses[0], sharded))}


def join_sharded_clipping(counts, norm_type):
    """``opt.clip_grad_norm_()`` at every step inside join() with the gradients sharded, before and after ranks
    joined (the ranks still training add up their norms point to point): every rank training gets the norm one
    process gets over the averaged gradients of the ranks present, and training follows that process clipping
    with ``torch.nn.utils.clip_grad_norm_``."""
    rank = dist.get_rank()
    model = Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                               shard_state="gradients", stall_timeout=30)  # ranks out of step fail in time
    norms = []
    with opt.join():
        for step in range(counts[rank]):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            norms.append(opt.clip_grad_norm_(0.05, norm_type).item())
            opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    identical = all(all(torch.equal(a, b) for a, b in zip(params, o)) for o in distopt.all_gather_object(params))
    opt.close()
    ref_model = Net()
    ref = torch.optim.Adam(param_groups(ref_model), lr=0.01)
    ref_norms = []
    for step in range(max(counts)):
        present = [r for r in range(len(counts)) if counts[r] > step]
        ref.zero_grad()
        (sum(nn.functional.mse_loss(ref_model(batch(step, r)[0]), batch(step, r)[1]) for r in present)
         / len(present)).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05, norm_type).item())
        ref.step()
    return {"identical": identical, "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
            "clipped": sum(n > 0.05 for n in ref_norms),
            "diff": max((a - b).abs().max().item() for a, b in zip(params, ref_model.parameters()))}


def state_dict_inside_join(counts, at, shard_state):
    """``opt.state_dict()`` at the top of step ``at`` inside join() on every rank that still has data: with a rank
    out of data (just now, or since a round) its gather must not meet that rank's shadow round; with every rank
    training it gathers as outside a block, and training goes on to the same end as without it."""
    rank = dist.get_rank()
    finals, saved = [], None
    for save in (True, False):
        model = Net()
        opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                                   shard_state=shard_state, stall_timeout=10)
        error, start = None, time.monotonic()
        try:
            with opt.join():
                for step in range(counts[rank]):
                    if save and step == at:
                        saved = len(opt.state_dict()["state"])
                    x, y = batch(step)
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
        except RuntimeError as exc:
            error = str(exc)
        finals.append([p.detach().clone() for p in model.parameters()])
        opt.close()
        if error is not None:
            return {"error": error, "seconds": time.monotonic() - start}
    return {"error": None, "saved": saved, "bitwise": all(torch.equal(a, b) for a, b in zip(*finals))}


def join_sharded_scaler(counts, infs, shard_state=True):
    """GradScaler inside join(): an inf in every training rank's loss at each step in ``infs`` (before and after
    ranks joined) skips that step. Against one process that averages the ranks present and skips those steps.
    With ``shard_state="gradients"`` a joined rank owns nothing: the gradients it received, reduce-scattered in
    the round in which it joined, go to their new owners, and the packs are grouped by the new owners."""
    rank = dist.get_rank()
    model = Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                               shard_state=shard_state, stall_timeout=30)  # ranks out of step fail in time
    owned_after_join = None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    stepped = []
    with opt.join():
        for step in range(counts[rank]):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if step in infs:
                loss = loss * float("inf")  # every rank still training: averaged gradients are inf everywhere
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            stepped.append(scaler.get_scale() == scale)
            if shard_state == "gradients":  # who owns a parameter now: the ranks still training
                owned_after_join = sorted(set(opt.mode.owner_of.values()))
    params = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    identical = all(all(torch.equal(a, b) for a, b in zip(params, o)) for o in distopt.all_gather_object(params))
    opt.close()
    ref_model = Net()
    ref = torch.optim.Adam(param_groups(ref_model), lr=0.01)
    for step in range(max(counts)):
        if step in infs:
            continue
        present = [r for r in range(len(counts)) if counts[r] > step]
        ref.zero_grad()
        (sum(nn.functional.mse_loss(ref_model(batch(step, r)[0]), batch(step, r)[1]) for r in present)
         / len(present)).backward()
        ref.step()
    ref_state = ref.state_dict()
    return {"identical": identical, "stepped": stepped, "owners": owned_after_join,
            "diff": max((a - b).abs().max().item() for a, b in zip(params, ref_model.parameters())),
            "state_diff": max((a - b).abs().max().item() for (_, _, a), (_, _, b) in
                              zip(tensors_of(state), tensors_of(ref_state))),
            "same_layout": [(k, n) for k, n, _ in tensors_of(state)] == [(k, n) for k, n, _ in tensors_of(ref_state)]}


def attempt(opt, state_dict):
    """``opt.load_state_dict(state_dict)``: None, or the ValueError's message."""
    try:
        opt.load_state_dict(state_dict)
    except ValueError as exc:
        return str(exc)
    return None


def shard_loads():
    """Which shards load as they are: this rank's own, an older one of its own, and a world of one's (anywhere)."""
    rank = dist.get_rank()
    model = Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state=True)
    train(model, opt, 3)
    shards = distopt.all_gather_object(opt.sharded_state_dict())
    own, other = shards[rank], shards[1 - rank]
    held = opt.stats.optimizer_state_bytes
    errors = {
        "another rank's": attempt(opt, other),
        "another world size's": attempt(opt, dict(own, shard=dict(own["shard"], world_size=3))),
        "older, another rank's state": attempt(opt, dict(other, shard={"rank": rank, "world_size": 2})),
    }
    held_after_refusals = opt.stats.optimizer_state_bytes
    errors["older, own"] = attempt(opt, dict(own, shard={"rank": rank, "world_size": 2}))
    errors["own"] = attempt(opt, own)
    errors["unsharded wrapper"] = attempt(DistributedOptimizer(torch.optim.Adam(param_groups(Net()), lr=0.01)), own)
    # A group of this rank alone: shard_state=True in a world of one saves its one shard, the whole state.
    solo_group = [dist.new_group([r]) for r in range(2)][rank]
    solo_model = Net()
    solo = DistributedOptimizer(torch.optim.Adam(param_groups(solo_model), lr=0.01), process_group=solo_group,
                                shard_state=True)
    train(solo_model, solo, 3)
    one = distopt.all_gather_object(solo.sharded_state_dict())[0]  # rank 0's, loaded on every rank
    merged_equal = [(k, n, v.tolist()) for k, n, v in tensors_of(distopt.merge_state_dicts([one]))] == \
        [(k, n, v.tolist()) for k, n, v in tensors_of(distopt.all_gather_object(solo.state_dict())[0])] != []
    finals = []
    for shard in (True, False):
        model = Net()
        model.load_state_dict(distopt.all_gather_object(solo_model.state_dict())[0])
        loader = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state=shard)
        errors[f"world of one, into {'a sharded' if shard else 'an unsharded'} wrapper"] = attempt(loader,
                                                                                              copy.deepcopy(one))
        train(model, loader, 3, start=10)
        finals.append([p.detach().clone() for p in model.parameters()])
        loader.close()
    solo.close()
    opt.close()
    return {"errors": errors, "held": held, "held_after_refusals": held_after_refusals, "meta": one["shard"],
            "merged_equal": merged_equal, "diff": max((a - b).abs().max().item() for a, b in zip(*finals))}


def own_shard_after_add_param_group():
    """A shard saved after add_param_group, into a wrapper built with both groups (owned differently)."""
    model = Net()
    groups = param_groups(model)
    opt = DistributedOptimizer(torch.optim.Adam(groups[:1], lr=0.01), named_parameters=model.named_parameters(),
                               shard_state=True)
    train(model, opt, 2)
    opt.add_param_group(groups[1])
    train(model, opt, 2, start=2)
    shard, model_state = copy.deepcopy((opt.sharded_state_dict(), model.state_dict()))
    merged = distopt.merge_state_dicts(distopt.all_gather_object(shard))
    train(model, opt, 3, start=4)
    straight = [p.detach().clone() for p in model.parameters()]
    opt.close()
    model = Net()
    model.load_state_dict(model_state)
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), named_parameters=model.named_parameters(),
                               shard_state=True)
    error = attempt(opt, shard)
    held = opt.stats.optimizer_state_bytes
    opt.load_state_dict(merged)
    train(model, opt, 3, start=4)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), straight))
    opt.close()
    return {"error": error, "held_after_refusal": held, "diff": diff}


def step_hooks():
    """Step hooks (on the wrapper, and global ones) with and without shard_state: what they see, and a weight EMA."""
    runs = []
    for shard in (False, True):
        model = Net()
        params = list(model.parameters())
        opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                                   shard_state=shard)
        ema, log = [p.detach().clone() for p in params], []

        def seen(where):
            return lambda o, args, kwargs: log.append(
                (where, o is opt.optimizer, sum(len(g["params"]) for g in o.param_groups),
                 sum(p.detach().sum().item() for p in params)))

        def update_ema(o, args, kwargs):
            with torch.no_grad():
                for e, p in zip(ema, params):
                    e.mul_(0.9).add_(p, alpha=0.1)

        handles = [opt.register_step_pre_hook(seen("pre")), opt.register_step_post_hook(seen("post")),
                   opt.register_step_post_hook(update_ema),
                   register_optimizer_step_pre_hook(seen("global pre")),
                   register_optimizer_step_post_hook(seen("global post"))]
        train(model, opt, 4)
        for handle in handles:
            handle.remove()
        opt.close()
        runs.append((log, ema))
    (plain_log, plain_ema), (log, ema) = runs
    identical = all(all(torch.equal(a, b) for a, b in zip(ema, o)) for o in distopt.all_gather_object(ema))
    return {"plain_log": plain_log, "log": log, "identical": identical,
            "ema_diff": max((a - b).abs().max().item() for a, b in zip(ema, plain_ema))}


def drift_check(shard_state=True):
    """Sharded state under a drift check at every step: each rank's own shard of the state (and, with the
    gradients sharded, of the gradients) is no drift; a parameter moved on one rank is."""
    model = Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                               shard_state=shard_state, check_every=1, named_parameters=model.named_parameters())
    train(model, opt, 3)
    seen = (opt.stats.drift_checks, opt.stats.drifted)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.c.weight.add_(1e-3)
    try:
        opt.check_drift()
        error = None
    except distopt.DriftError as exc:
        error = str(exc)
    opt.close()
    return {"seen": seen, "error": error}


class Held(nn.Module):
    """A forward that reads its own parameter and a ParameterList's besides its children's; small parameters
    (which travel together) and a 64 KiB weight (which travels alone)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(4, 16)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))])
        self.shift = nn.Parameter(torch.zeros(2))
        self.wide = nn.Linear(16, 512)
        self.b = nn.Linear(512, 2)
        self.double()

    def forward(self, x):
        scale, bias = self.scales[0] * 1, self.scales[1] + self.shift.sum()  # read before any child runs
        return self.b(torch.tanh(self.wide(torch.tanh(self.a(x) * scale + bias))))


def drift_check_at_the_top_inside_join(counts, go_on=False, shard_state=True):
    """``opt.check_drift()`` at the top of every step inside join(): with ``counts`` uneven, a rank that ran out
    of data at the end of the last step waits in a shadow round the others know nothing of yet (an error on
    every rank, at once); with equal counts, or with ``go_on`` (the errors caught, training going on), the checks
    (each a probe round) leave the loop bitwise where it ends without them: the joined rank shadows a probe
    round and does nothing else for it (no hand-over of shards, which the others do not run).
    """
    rank = dist.get_rank()
    finals = []
    for every in (1, None):
        model = Net()
        opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                                   shard_state=shard_state, stall_timeout=10)
        # With the gradients sharded, opt.clip_grad_norm_() is refused once a rank has joined.
        outcome = checks_at_the_top(opt, counts[rank], lambda t: train(model, opt, 1, start=t,
                                                                       clip=shard_state is True), every, go_on)
        finals.append(([p.detach().clone() for p in model.parameters()], outcome))
        opt.close()
    (with_checks, outcome), (without, _) = finals
    return dict(outcome, bitwise=all(torch.equal(a, b) for a, b in zip(with_checks, without)))


def _reference_step_in_two_halves(ref, ref_opt, step, world):
    """One process's step on every rank's batch of ``step``, each in two halves whose losses add up."""
    ref_opt.zero_grad()
    whole = sum(nn.functional.mse_loss(ref(batch(step, r)[0][:3]), batch(step, r)[1][:3])
                + nn.functional.mse_loss(ref(batch(step, r)[0][3:]), batch(step, r)[1][3:]) for r in range(world))
    (whole / world).backward()
    ref_opt.step()


def drift_check_between_backward_and_step_inside_join(steps=3):
    """With the gradients sharded, ``opt.check_drift()`` inside join() after ``synchronize()`` and before
    ``step()``: its probe round reduce-scatters zeros of its own, so the owned gradients ``step()`` then
    applies are this step's, bitwise (the loop equals the one without checks)."""
    finals = []
    for check in (True, False):
        model = Net()
        opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                                   shard_state="gradients", stall_timeout=10)
        with opt.join():
            for step in range(steps):
                x, y = batch(step)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.synchronize()
                if check:
                    opt.check_drift()
                opt.step()
        finals.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    return all(torch.equal(a, b) for a, b in zip(*finals))


def in_step_share(world):
    """The default share: the last rank sends its own late, and right after step(), without opt.synchronize(),
    every parameter read directly (a weight EMA over model.parameters(), as a user writes one) is the one
    process's, on every rank."""
    rank = dist.get_rank()
    model, ref = Held(), Held()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), pack_threshold=256, shard_state=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ema, ref_ema = [p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in ref.parameters()]
    diffs = []
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if rank == world - 1:
            time.sleep(0.25)  # its parameters leave late: a share still in flight would be read stale
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.5).add_(p, alpha=0.5)
        ref_opt.zero_grad()
        whole = sum(nn.functional.mse_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(world))
        (whole / world).backward()
        ref_opt.step()
        with torch.no_grad():
            for e, p in zip(ref_ema, ref.parameters()):
                e.mul_(0.5).add_(p, alpha=0.5)
        diffs.append(max((a - b).abs().max().item() for a, b in zip(ema, ref_ema)))
    sent = (opt.stats.parameter_bytes, sum(p.numel() * p.element_size() for p in opt.optimizer.state) * (world - 1))
    opt.close()
    return {"ema": diffs, "sent": sent}


def lazy_share(world):
    """ShardedState(share="background"): the parameters travel after step() returns, and the last rank sends
    its own late. Right after step(),
    without opt.synchronize(): a forward and model.state_dict() see the one process's parameters, and close()
    waits for them; a parameter changed in place before they arrived is an error naming the fix."""
    rank = dist.get_rank()
    model, ref = Held(), Held()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), pack_threshold=256,
                               mode=distopt.ShardedState(share="background"))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    probe = torch.randn(5, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    forward_diffs, state_diffs, step_seconds = [], [], []
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if rank == world - 1 and step < 2:
            time.sleep(0.25)  # its parameters leave late: the others' next forward must wait for them
        start = time.perf_counter()
        opt.step()  # the others' returns at once: the share runs on
        step_seconds.append(time.perf_counter() - start)
        ref_opt.zero_grad()
        whole = sum(nn.functional.mse_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(world))
        (whole / world).backward()
        ref_opt.step()
        if step == 0:  # stats count the parameters this rank sent, each once to every other rank
            owned = sum(p.numel() * p.element_size() for p in opt.optimizer.state)
            sent = (opt.stats.parameter_bytes, opt.stats.bytes, owned * (world - 1))
        if step == 1:
            ours, theirs = model.state_dict(), ref.state_dict()
            state_diffs.append(max((ours[k] - theirs[k]).abs().max().item() for k in theirs))
        with torch.no_grad():
            forward_diffs.append((model(probe) - ref(probe)).abs().max().item())
    x, y = batch(3)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if rank == world - 1:
        time.sleep(0.25)
    opt.step()
    opt.close()  # never synchronized: close() waits for the share
    ref_opt.zero_grad()
    (sum(nn.functional.mse_loss(ref(batch(3, r)[0]), batch(3, r)[1]) for r in range(world)) / world).backward()
    ref_opt.step()
    closed_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    # A parameter clamped in place before the share was finished: the ranks would differ, so it raises.
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), pack_threshold=256,
                               mode=distopt.ShardedState(share="background"), named_parameters=model.named_parameters())
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        model.b.weight.clamp_(-0.1, 0.1)
    try:
        opt.synchronize()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    opt.close()
    return {"forward": forward_diffs, "state_dict": state_diffs, "closed": closed_diff, "error": error, "sent": sent,
            "step_seconds": step_seconds, "late": rank == world - 1}


def sharded_gradients(world):
    """shard_state="gradients" against one process, SGD with momentum and Adam with two param groups (the
    second added after a step), a frozen and an unused parameter, 6 steps at world 2 and 3 (uneven slices): .grad is None for what
    this rank does not own, clip_grad_norm_ is the reference's, GradScaler skips on every rank where one
    rank's slice had an inf, and the bytes are plain distopt's (world 2; ring-equivalent otherwise)."""
    rank = dist.get_rank()
    out = {}
    for name in ("momentum", "adam"):
        model, ref, plain_model = Net(), Net(), Net()
        opt = DistributedOptimizer(OPTIMIZERS[name](param_groups(model)[1:]), pack_threshold=256,
                                   shard_state="gradients")
        plain = DistributedOptimizer(OPTIMIZERS[name](param_groups(plain_model)[1:]), pack_threshold=256)
        ref_opt = OPTIMIZERS[name](param_groups(ref)[1:])
        norms, foreign_none, owned_present = [], True, True
        for step in range(6):
            if step == 1:  # the second group arrives after the first step: planned by owner too
                for m, o in ((model, opt), (plain_model, plain), (ref, ref_opt)):
                    o.add_param_group(param_groups(m)[0])
            for m, o in ((model, opt), (plain_model, plain)):
                x, y = batch(step)
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
            owned = opt.mode.owner_of
            for p in model.parameters():
                if id(p) in owned and p.requires_grad and p is not model.unused.weight and p is not model.unused.bias:
                    if owned[id(p)] == rank:
                        owned_present = owned_present and p.grad is not None
                    else:
                        foreign_none = foreign_none and p.grad is None
            norm = opt.clip_grad_norm_(0.5)
            plain.step()
            opt.step()
            ref_opt.zero_grad()
            whole = sum(nn.functional.mse_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(world))
            (whole / world).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]], 0.5)
            ref_opt.step()
            norms.append(abs(norm.item() - ref_norm.item()))
            if step == 2:
                flags = sum(pack.flags.numel() * pack.flags.element_size() for pack in opt._engine.packs)
                sent = (opt.stats.bytes, plain.stats.bytes, opt.stats.parameter_bytes, flags)
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        out[name] = {"diff": diff, "norm": max(norms), "foreign_none": foreign_none, "owned": owned_present,
                     "sent": sent}
        opt.close()
        plain.close()
    # GradScaler: an inf on the last rank's batch at step 1 only; every rank skips that step, and trains on.
    model, ref = Net(), Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), pack_threshold=256,
                               shard_state="gradients")
    ref_opt = torch.optim.Adam(param_groups(ref), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    stepped = []
    for step in range(4):
        x, y = batch(step)
        if step == 1 and rank == world - 1:
            x = x.clone()
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        stepped.append(scaler.get_scale())
        if step != 1:
            ref_opt.zero_grad()
            whole = sum(nn.functional.mse_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(world))
            (whole / world).backward()
            ref_opt.step()
    opt.close()
    out["scaler"] = {"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
                     "scales": stepped}
    # A gradient of 2 MiB travels alone, reduce-scattered from where autograd left it; not owned, it is let go.
    # The first layer's (1 MiB, 1024 rows) is never sent as rows (their dense fallback would all-reduce it).
    # At step 1 the last rank pauses in the middle of its backward, longer than the others wait at the end of
    # theirs: their round stays pending, and step() waits again for what it had waited for.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(128, 1024), nn.Tanh(), nn.Linear(1024, 256), nn.Tanh(), nn.Linear(256, 64)).double()
    ref = copy.deepcopy(model)
    # Received in parts of 256 KiB, each added as it arrives, into room for one part from each other rank.
    saved_part, in_flight.SCATTER_PART_BYTES = in_flight.SCATTER_PART_BYTES, 1 << 18
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), shard_state="gradients",
                               pack_threshold=1 << 16)
    opt._engine.backward_patience, opt._engine.patience_growth = 0.2, 0.0
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    large, large_grad = model[2].weight, True
    for step in range(3):
        x, y = batch(step)
        x, y = x.repeat(1, 32), y.repeat(1, 32)
        opt.zero_grad()
        hidden = model[1](model[0](x))
        if step == 1 and rank == world - 1:  # the last two layers' gradients have left; the first's have not
            hidden.register_hook(lambda g: time.sleep(1.0))
        nn.functional.mse_loss(model[4](model[3](model[2](hidden))), y).backward()
        opt.synchronize()  # a round left pending at the end of backward (step 1) settles here
        large_grad = large_grad and (opt.mode.owner_of[id(large)] == rank) == (large.grad is not None)
        opt.step()
        ref_opt.zero_grad()
        (sum(nn.functional.mse_loss(ref(batch(step, r)[0].repeat(1, 32)), batch(step, r)[1].repeat(1, 32))
             for r in range(world)) / world).backward()
        ref_opt.step()
    out["large"] = {"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
                    "direct": any(pack.direct for pack in opt._engine.packs), "grad_where_owned": large_grad,
                    "rows": any(pack.rows is not None for pack in opt._engine.packs),
                    "rooms": [pack.scattered.numel() for pack in opt._engine.packs if pack.direct and pack.owner == rank]}
    in_flight.SCATTER_PART_BYTES = saved_part
    opt.close()
    # Accumulation inside no_sync(): the first half-batch stays local, the second's backward reduces both.
    model, ref = Net(), Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state="gradients")
    ref_opt = torch.optim.Adam(param_groups(ref), lr=0.01)
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        with opt.no_sync():
            nn.functional.mse_loss(model(x[:3]), y[:3]).backward()
        nn.functional.mse_loss(model(x[3:]), y[3:]).backward()
        opt.step()
        _reference_step_in_two_halves(ref, ref_opt, step, world)
    opt.close()
    out["no_sync"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    # backward_passes_per_step=2: the first pass stays local, the second reduces both to their owners.
    model, ref = Net(), Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state="gradients",
                               backward_passes_per_step=2, pack_threshold=256)
    ref_opt = torch.optim.Adam(param_groups(ref), lr=0.01)
    foreign_none = True
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[:3]), y[:3]).backward()
        nn.functional.mse_loss(model(x[3:]), y[3:]).backward()
        foreign_none = foreign_none and all(p.grad is None for p in model.parameters()
                                            if p.requires_grad and id(p) in opt.mode.owner_of and not opt.mode.mine(p))
        opt.step()
        _reference_step_in_two_halves(ref, ref_opt, step, world)
    opt.close()
    out["passes"] = {"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
                     "foreign_none": foreign_none}
    return out


CASES = {}
for group_and_size in (2, 3):
    CASES[f"sharded gradients, world {group_and_size}"] = (group_and_size, sharded_gradients, (group_and_size,))
    for _name in OPTIMIZERS:
        CASES[f"{_name}, world {group_and_size}"] = (group_and_size, parity, (_name,))

CASES["features"] = (2, full_state_dict_and_features, ("{tmp}/ckpt2.pt",))
CASES["state_dict on one rank"] = (2, state_dict_on_one_rank, ())
CASES["join"] = (3, join_sharded, ([5, 2, 4],))
CASES["join, world 2"] = (2, join_sharded, ([5, 3],))
# GradScaler skips a step with every rank training (step 1), and after a rank joined
CASES["join, closure twice per step"] = (3, join_sharded_closure, ([5, 2, 4],))
CASES["join, scaler skips, world 2"] = (2, join_sharded_scaler, ([6, 3], {1, 4}))
CASES["join, scaler skips, world 3"] = (3, join_sharded_scaler, ([6, 2, 4], {1, 3, 5}))
CASES["join, scaler skips, world 2, gradients"] = (2, join_sharded_scaler, ([6, 3], {1, 4}, "gradients"))
CASES["join, scaler skips, world 3, gradients"] = (3, join_sharded_scaler, ([6, 2, 4], {1, 3, 5}, "gradients"))
for norm_type in (2.0, float("inf")):
    CASES[f"join, clipping, world 3, norm {norm_type}"] = (3, join_sharded_clipping, ([5, 2, 4], norm_type))
CASES["join, clipping, world 2, norm 2.0"] = (2, join_sharded_clipping, ([6, 3], 2.0))
for _shard in (True, "gradients"):
    for _name, _counts, _at in (("just out of data", [5, 2], 2), ("out of data since a round", [5, 2], 3),
                                ("every rank training", [4, 4], 2)):
        CASES[f"state_dict inside join, {_name}, {_shard}"] = (2, state_dict_inside_join, (_counts, _at, _shard))
CASES["shard loads"] = (2, shard_loads, ())
CASES["own shard after add_param_group"] = (2, own_shard_after_add_param_group, ())
CASES["step hooks"] = (2, step_hooks, ())
for group_and_size in (2, 3):
    for _shard in (True, "gradients"):
        CASES[f"drift, {_shard}, world {group_and_size}"] = (group_and_size, drift_check, (_shard,))
CASES["wrap loaded"] = (2, wrap_loaded, ("{tmp}",))
for name, counts, go_on in (("a rank just out of data", [5, 3], False), ("equal counts", [4, 4], False),
                            ("errors caught", [5, 3], True)):
    CASES[f"check_drift at the top inside join, {name}"] = (2, drift_check_at_the_top_inside_join, (counts, go_on))
# The probe round reduce-scatters zeros of its own: the owners' chunks of the real packs stay as they are.
CASES["check_drift between backward and step inside join, gradients sharded"] = (
    2, drift_check_between_backward_and_step_inside_join, ())
CASES["check_drift at the top inside join, gradients sharded, errors caught"] = (
    2, drift_check_at_the_top_inside_join, ([5, 3], True, "gradients"))
for group_and_size in (2, 3):
    CASES[f"lazy share, world {group_and_size}"] = (group_and_size, lazy_share, (group_and_size,))
    CASES[f"in-step share, world {group_and_size}"] = (group_and_size, in_step_share, (group_and_size,))

WORLDS = Worlds(CASES, timeout=240)
_TMP = {}


def results(case, tmp_path_factory):
    world = CASES[case][0]
    if world not in _TMP:
        _TMP[world] = tmp_path_factory.mktemp("sharded")
    return WORLDS.results(case, tmp=str(_TMP[world]))


@pytest.mark.parametrize("case", [n for n, c in CASES.items() if c[1] is parity])
def test_sharded_state_trains_exactly_like_the_unsharded_wrapper_and_holds_a_share(case, tmp_path_factory):
    world = CASES[case][0]
    for r in results(case, tmp_path_factory):
        assert r["diff"] < TOL, r
        assert r["identical"], r
        assert r["held"] <= r["full"] / world + r["largest"], r
        assert r["held"] < r["full"], r


@pytest.mark.parametrize("world", [2, 3])
def test_step_returns_before_the_parameters_arrive_and_forward_state_dict_and_close_wait_so_never_read_stale(
        world, tmp_path_factory):
    for r in results(f"lazy share, world {world}", tmp_path_factory):
        assert max(r["forward"]) < TOL and max(r["state_dict"]) < TOL and r["closed"] < TOL, r
        assert r["error"] is not None and "changed in place after opt.step()" in r["error"], r
        assert "b.weight" in r["error"] and "Call opt.synchronize() right after opt.step()" in r["error"], r
        parameter_bytes, total, expected = r["sent"]
        if not r["late"]:  # step() did not wait for the late rank's parameters
            assert max(r["step_seconds"][:2]) < 0.12, r
        assert parameter_bytes == expected > 0 and total > parameter_bytes, r


@pytest.mark.parametrize("world", [2, 3])
def test_by_default_every_parameter_is_every_ranks_when_step_returns_so_a_weight_ema_reads_no_stale_value(
        world, tmp_path_factory):
    for r in results(f"in-step share, world {world}", tmp_path_factory):
        assert max(r["ema"]) < TOL, r
        parameter_bytes, expected = r["sent"]
        assert parameter_bytes == expected > 0, r


def test_check_drift_at_the_top_of_a_join_loop_raises_at_once_after_a_rank_ran_out_and_changes_nothing_else(
        tmp_path_factory):
    # Before, its all-gather met the joined rank's shadow round and every rank waited for the stall timeout.
    trainer, joined = results("check_drift at the top inside join, a rank just out of data", tmp_path_factory)
    assert trainer["checks"] == 3 and trainer["seconds"] < 8, trainer
    assert trainer["error"].startswith("check_drift() was called inside a join block after a rank ran out of data"), \
        trainer
    assert joined["seconds"] < 8 and "rank 0 is gone" in joined["error"], joined
    assert trainer["error"] in joined["error"], joined  # the joined rank says why the others left
    for r in results("check_drift at the top inside join, equal counts", tmp_path_factory):
        assert r["error"] is None and r["checks"] == 4 and r["bitwise"], r
    assert all(results("check_drift between backward and step inside join, gradients sharded", tmp_path_factory))
    for case in ("errors caught", "gradients sharded, errors caught"):
        trainer, joined = results(f"check_drift at the top inside join, {case}", tmp_path_factory)
        assert trainer["checks"] == 3 and trainer["errors"] == 2 and trainer["bitwise"], (case, trainer)
        assert joined["checks"] == 3 and joined["errors"] == 0 and joined["bitwise"], (case, joined)
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_gradients_train_like_one_process_with_clipping_scaler_and_grads_only_where_owned(
        world, tmp_path_factory):
    ranks = results(f"sharded gradients, world {world}", tmp_path_factory)
    for name in ("momentum", "adam"):
        for r in ranks:
            case = r[name]
            assert case["diff"] < TOL and case["norm"] < TOL, (name, case)
            assert case["foreign_none"] and case["owned"], (name, case)
            total, plain_total, parameter_bytes, flags = case["sent"]
            assert parameter_bytes > 0, case
            if world == 2:  # the other half of the gradients out, this half's parameters back: plain's bytes
                assert total == plain_total, case
        # What leaves the ranks together: every gradient but the owner's copy, and every parameter to each
        # other rank (2(N-1) times the gradients, a ring all-reduce's); the flags travel whole from each rank.
        total = sum(r[name]["sent"][0] for r in ranks)
        _, plain_total, _, flags = ranks[0][name]["sent"]
        assert total == 2 * (world - 1) * (plain_total - flags) + world * flags, (name, ranks)
    for r in ranks:
        scaler = r["scaler"]
        assert scaler["diff"] < TOL, scaler
        assert scaler["scales"] == [16.0, 8.0, 8.0, 8.0], scaler  # step 1 skipped on every rank alike
        assert r["no_sync"] < TOL, r["no_sync"]
        assert r["passes"]["diff"] < TOL and r["passes"]["foreign_none"], r["passes"]
        assert r["large"]["diff"] < TOL and r["large"]["direct"] and r["large"]["grad_where_owned"], r["large"]
        assert not r["large"]["rows"], r["large"]
        assert all(room == (world - 1) * (1 << 15) for room in r["large"]["rooms"]), r["large"]
    assert any(r["large"]["rooms"] for r in ranks), ranks  # some rank owns a gradient of 1 MiB or more


@pytest.mark.parametrize("case", [n for n in CASES if n.startswith("drift, ")])
def test_the_drift_check_ignores_each_ranks_own_shard_and_names_a_parameter_moved_on_one_rank(case, tmp_path_factory):
    for r in results(case, tmp_path_factory):
        assert r["seen"] == (3, 0)
        assert "parameter 'c.weight' differs between ranks by 0.001" in r["error"]
        assert "not the optimizer state: each rank holds its own shard of it" in r["error"]


def test_accumulation_no_sync_compression_bcast_scaler_and_new_groups_keep_working(tmp_path_factory):
    for r in results("features", tmp_path_factory):
        assert r["diff"] < TOL and r["state_diff"] < TOL and r["same_layout"], r


def test_an_optimizer_loaded_before_it_is_wrapped_resumes_bitwise_like_one_loaded_after(tmp_path_factory):
    for r in results("wrap loaded", tmp_path_factory):
        assert r == {False: True, True: True}


def test_the_gathered_checkpoint_loads_into_a_plain_optimizer_as_it_is(tmp_path_factory):
    results("features", tmp_path_factory)
    checkpoint = torch.load(_TMP[2] / "ckpt2.pt")
    model = Net()
    plain = torch.optim.Adam(param_groups(model), lr=0.01)
    plain.load_state_dict(checkpoint["optimizer"])
    assert [(k, n) for k, n, _ in tensors_of(plain.state_dict())] == \
        [(k, n) for k, n, _ in tensors_of(checkpoint["optimizer"])]
    assert len(plain.state) == sum(1 for p in model.parameters() if p.requires_grad) - 2  # `unused` has none


@pytest.mark.parametrize("saved", ["sharded", "plain"])
@pytest.mark.parametrize("world", [3, 2])
def test_a_checkpoint_resumes_exactly_sharded_or_not_at_another_world_size(world, saved, tmp_path_factory):
    results("features", tmp_path_factory)
    path = _TMP[2] / ("ckpt2.pt" if saved == "sharded" else "ckpt2-plain.pt")
    for (a, held_a), (b, held_b), (c, held_c) in run_world(resume_both_ways, world, str(path), timeout=150):
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) < TOL
        assert max((x - y).abs().max().item() for x, y in zip(c, b)) < TOL
        assert held_a < held_b and held_c == held_a  # the loaded state kept only this rank's shard


def test_state_dict_on_one_rank_only_is_a_clear_error_not_a_hang(tmp_path_factory):
    (error, complete_0), (none, complete_1) = results("state_dict on one rank", tmp_path_factory)
    assert none is None
    assert "ranks [1] did not call it within 2 s" in error and "call opt.state_dict() on every rank" in error, error
    assert complete_0 == complete_1 > 0


@pytest.mark.parametrize("case", ["join", "join, world 2"])
def test_join_with_uneven_batches_and_a_scheduler_trains_like_the_unsharded_wrapper(case, tmp_path_factory):
    for r in results(case, tmp_path_factory):
        assert r["diff"] < TOL and r["identical"], r


@pytest.mark.parametrize("shard", ["", ", gradients"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_step_gradscaler_skips_after_a_rank_joined_trains_like_one_process_skipping_it(world, shard,
                                                                                         tmp_path_factory):
    counts, infs = CASES[f"join, scaler skips, world {world}{shard}"][2][:2]
    for rank, r in enumerate(results(f"join, scaler skips, world {world}{shard}", tmp_path_factory)):
        assert r["stepped"] == [step not in infs for step in range(counts[rank])], r  # the scaler did skip them
        assert r["identical"] and r["same_layout"], r
        assert r["diff"] < TOL and r["state_diff"] < TOL, r
        if shard and rank == 0:  # at its last step every other rank had joined: it owns everything
            assert r["owners"] == [0], r


@pytest.mark.parametrize("case", [n for n in CASES if n.startswith("join, clipping")])
def test_clipping_sharded_gradients_after_ranks_joined_uses_the_norm_of_the_ranks_present_on_every_rank(
        case, tmp_path_factory):
    counts = CASES[case][2][0]
    for rank, r in enumerate(results(case, tmp_path_factory)):
        assert r["norm_diff"] < TOL and r["diff"] < TOL and r["identical"], r
        assert r["clipped"] == max(counts), r  # every step clipped: the norm decides every update


@pytest.mark.parametrize("case", [n for n in CASES if n.startswith("state_dict inside join") and "every rank" not in n])
def test_a_sharded_state_dict_inside_join_after_a_rank_ran_out_raises_at_once_on_every_rank_saying_when_to_save(
        case, tmp_path_factory):
    # Its gather met the joined rank's shadow round: it waited for the stall timeout and then blamed the joined
    # rank for not calling state_dict(). Now the last round's flags, or a probe round it shadows, say so first.
    trainer, joined = results(case, tmp_path_factory)
    assert trainer["seconds"] < 8 and trainer["error"].startswith(
        "state_dict() was called inside a join block after a rank ran out of data: with the optimizer state sharded "
        "it gathers every rank's shard"), trainer
    assert "state_dict() inside a join block" in joined["error"] and "save after the block" in joined["error"], joined


@pytest.mark.parametrize("shard", [True, "gradients"])
def test_a_sharded_state_dict_inside_join_while_every_rank_trains_gathers_and_changes_nothing(shard, tmp_path_factory):
    for r in results(f"state_dict inside join, every rank training, {shard}", tmp_path_factory):
        assert r["error"] is None and r["saved"] > 0 and r["bitwise"], r


def test_a_closure_evaluated_twice_per_step_after_a_rank_joined_trains_like_the_unsharded_wrapper(
        tmp_path_factory):
    for r in results("join, closure twice per step", tmp_path_factory):
        assert r["diff"] < TOL and r["loss_diff"] < TOL and r["identical"], r


def test_lbfgs_cannot_be_sharded_and_says_why():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="shard_state=True cannot shard LBFGS"):
        DistributedOptimizer(torch.optim.LBFGS(model.parameters()), shard_state=True)
    with pytest.raises(TypeError, match="shard_state must be True, False or 'gradients'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard_state="yes")


def test_sharded_gradients_refuse_what_they_do_not_support_yet_naming_the_fix():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"gradients=True\) \(the gradients reduce-scattered .* cannot be compressed "
                                         r"with PowerSGD.*the casts work"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode=distopt.ShardedState(gradients=True),
                             compression="powersgd")
    with pytest.raises(TypeError, match=r"ShardedState\(gradients='yes'\): gradients must be True or False"):
        distopt.ShardedState(gradients="yes")
    assert repr(distopt.ShardedState(gradients=True)) == "ShardedState(gradients=True)"
    assert distopt.ShardedState(gradients=True).settings()["shard_state"] == "gradients"


def test_the_share_is_in_step_or_background_and_says_so():
    assert repr(distopt.ShardedState()) == "ShardedState()"
    assert repr(distopt.ShardedState(share="background")) == "ShardedState(share='background')"
    assert distopt.ShardedState().settings()["shard_state_share"] == "in_step"
    with pytest.raises(ValueError, match=r"ShardedState\(share='lazy'\): share must be 'in_step' .* or 'background'"):
        distopt.ShardedState(share="lazy")


def test_merging_shards_needs_one_of_each_rank():
    with pytest.raises(ValueError, match=r"needs one shard of each rank 0\.\.1 .* got ranks \[0, 0\]"):
        distopt.merge_state_dicts([{"shard": {"rank": 0, "world_size": 2}, "state": {}, "param_groups": []}] * 2)


MERGE = r"merge every rank's shard of that save with distopt.merge_state_dicts\("


def test_a_shard_loads_as_it_is_only_into_its_own_rank_and_world_size_and_otherwise_says_what_differs(
        tmp_path_factory):
    for rank, r in enumerate(results("shard loads", tmp_path_factory)):
        errors = r["errors"]
        assert re.search(rf"on rank {rank} got rank {1 - rank}'s shard \(of a save at world size 2\): each rank "
                         rf"loads its own shard .*, or {MERGE}", errors["another rank's"])
        assert re.search(rf"got rank {rank}'s shard of a save at world size 3, but this optimizer runs at world size 2"
                         rf".*; {MERGE}", errors["another world size's"])
        assert re.search(rf"the shard holds state of parameters that another rank owns here: param_groups\[.*"
                         rf"\(rank {1 - rank} here\).*would drop their state; {MERGE}",
                         errors["older, another rank's state"])
        assert re.search(rf"it holds the optimizer state of that rank's parameters only, and this optimizer keeps "
                         rf"all of it; {MERGE}", errors["unsharded wrapper"])
        assert r["held_after_refusals"] == r["held"] > 0  # a refused load drops nothing
        assert errors["older, own"] is errors["own"] is None
        # a world of one saves one shard, the whole state: it merges, and loads sharded or not alike
        assert r["meta"] == {"rank": 0, "world_size": 1, "owners": [0] * 10} and r["merged_equal"]
        assert errors["world of one, into a sharded wrapper"] is errors["world of one, into an unsharded wrapper"] is None
        assert r["diff"] < TOL


def test_an_own_shard_whose_parameters_moved_owner_is_refused_naming_them_and_merged_shards_resume(tmp_path_factory):
    for rank, r in enumerate(results("own shard after add_param_group", tmp_path_factory)):
        assert re.search(rf"on rank {rank}: the parameters' owners differ from the save's: .*b\.weight \(rank 1 at "
                         rf"the save, rank 0 here\).*add_param_group.*; {MERGE}", r["error"]), r["error"]
        assert r["held_after_refusal"] == 0
        assert r["diff"] < TOL


def test_step_hooks_see_every_parameter_around_the_whole_sharded_step_as_unsharded(tmp_path_factory):
    for r in results("step hooks", tmp_path_factory):
        plain, sharded = r["plain_log"], r["log"]
        assert [e[:3] for e in sharded] == [e[:3] for e in plain]
        assert [e[0] for e in plain] == ["global pre", "pre", "post", "global post"] * 4
        assert all(n == 10 and inner for _, inner, n, _ in sharded)
        assert max(abs(a[3] - b[3]) for a, b in zip(sharded, plain)) < 1e-8  # parameters before and after the step
        assert r["ema_diff"] < TOL and r["identical"], r


def test_shard_state_without_a_process_group_saves_one_shard_that_merges_and_loads():
    model = Net()
    opt = DistributedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), shard_state=True)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    shard = opt.sharded_state_dict()
    assert shard["shard"] == {"rank": 0, "world_size": 1, "owners": [0] * 10}
    merged = distopt.merge_state_dicts([shard])
    assert merged["param_groups"] == opt.state_dict()["param_groups"]
    again = DistributedOptimizer(torch.optim.Adam(param_groups(Net()), lr=0.01), shard_state=True)
    again.load_state_dict(shard)
    for sd in (merged, again.state_dict()):
        assert [(k, n, v.tolist()) for k, n, v in tensors_of(sd)] == \
            [(k, n, v.tolist()) for k, n, v in tensors_of(opt.state_dict())] != []
    plain = DistributedOptimizer(torch.optim.Adam(param_groups(Net()), lr=0.01))
    with pytest.raises(RuntimeError, match=r"sharded_state_dict\(\) needs shard_state=True; use state_dict\(\)"):
        plain.sharded_state_dict()
