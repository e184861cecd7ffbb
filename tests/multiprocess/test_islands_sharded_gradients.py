"""``Islands(inside=ShardedState(gradients=True))``: the gradients and the optimizer state sharded inside each
island (ZeRO-2), synchronous training (or DiLoCo) across.

Worlds of 4 ranks (2 islands x 2, ``[[0, 1], [2, 3]]``) and 6 (2 islands x 3), gloo, float64. Each check is
compared, in the test, with a single-process reference on the global batch: the parameters, the gradients
each rank holds after ``backward()`` (None exactly where another rank of its island owns the parameter),
``opt.clip_grad_norm_()``'s norm, ``GradScaler``'s skipped step and the gathered ``state_dict()``.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import DistributedOptimizer
from distopt.planning.control import CONTROL_FLAGS

from _worlds import Worlds

pytestmark = pytest.mark.timeout(400)

TOL = 1e-12
ROWS = 4
STEPS = 4
CLIP = 0.05  # below every step's global norm: the clipping bites
ISLANDS = {4: [[0, 1], [2, 3]], 6: [[0, 1, 2], [3, 4, 5]]}

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
}
OUTER = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731


class Net(nn.Module):
    """A body every rank uses (parameters of 32, 8, 16 and 2 values: uneven shards), a head only island 0 uses
    (another island's owner takes the mean with its zeros) and a head no rank uses (grad None everywhere)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        self.island0 = nn.Linear(4, 1).double()
        self.unused = nn.Linear(2, 2).double()

    def loss(self, x, y, first_island):
        loss = nn.functional.mse_loss(self.body(x), y)
        if first_island:
            loss = loss + self.island0(x).pow(2).mean()
        return loss


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(ROWS, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def grads_of(net):
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def copy_of(state):
    return copy.deepcopy(state)


# ---------------------------------------------------------------------- checks (on every rank)


def trained(optimizer, gradients, scaled=False):
    """``STEPS`` steps: backward, ``opt.clip_grad_norm_(CLIP)``, step. Returns what each step's backward left in
    ``.grad``, each step's norm, the parameters, the gathered ``state_dict()`` (every rank calls it), this rank's
    ``sharded_state_dict()``'s parameters, its owned parameters and each step's bytes across.

    ``scaled``: through ``GradScaler``, with an inf in the gradient of one parameter (``body.0.weight``) on the last
    rank at step 1, which another rank of its island owns: every rank of every island must skip that step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    islands = ISLANDS[world]
    net = Net()
    opt = DistributedOptimizer(OPTIMIZERS[optimizer](net.parameters()), mode=distopt.Islands(
        islands=islands, inside=distopt.ShardedState(gradients=gradients)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    grads, norms, across = [], [], []
    for t in range(STEPS):
        x, y = batch(rank, t)
        opt.zero_grad()
        loss = net.loss(x, y, rank in islands[0])
        handle = None
        if scaled and t == 1 and rank == world - 1:
            handle = net.body[0].weight.register_hook(lambda g: g * float("inf"))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if handle is not None:
            handle.remove()
        grads.append(grads_of(net))
        if scaler is None:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        across.append(opt.mode.across_stats.bytes)
    owned = [i for i, p in enumerate(net.parameters()) if opt.mode.inside.mine(p)]
    full = copy_of(opt.state_dict())
    shard = sorted(opt.sharded_state_dict()["state"])
    return {"grads": grads, "norms": norms, "params": [p.detach().clone() for p in net.parameters()],
            "state": full, "shard": shard, "owned": owned, "across": across,
            "scale": None if scaler is None else scaler.get_scale(),
            "place": [r for island in islands for r in island].index(rank) % len(islands[0])}


def diloco_across(gradients):
    """DiLoCo across (a sync every 2 steps, Adam inside), the state (and gradients) sharded inside or not."""
    rank = dist.get_rank()
    net = Net()
    inside = None if gradients is None else distopt.ShardedState(gradients=gradients)
    opt = DistributedOptimizer(OPTIMIZERS["adam"](net.parameters()), mode=distopt.Islands(
        distopt.DiLoCo(2, OUTER), islands=ISLANDS[4], inside=inside))
    norms = []
    for t in range(5):
        opt.zero_grad()
        net.loss(*batch(rank, t), rank in ISLANDS[4][0]).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
    return [p.detach().clone() for p in net.parameters()], norms


def compressed_across():
    """int8 across the islands: the owned gradients are decoded alike on rank j of every island, so every rank of
    every island ends with the same bits."""
    rank = dist.get_rank()
    net = Net()
    opt = DistributedOptimizer(OPTIMIZERS["sgd"](net.parameters()), mode=distopt.Islands(
        islands=ISLANDS[4], compression="int8", inside=distopt.ShardedState(gradients=True)))
    for t in range(STEPS):
        opt.zero_grad()
        net.loss(*batch(rank, t), rank in ISLANDS[4][0]).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


CASES = {
    "sgd": (4, trained, ("sgd", True)),
    "adam": (4, trained, ("adam", True)),
    "scaler": (4, trained, ("sgd", True, True)),
    "zero1 sgd": (4, trained, ("sgd", False)),
    "zero1 scaler": (4, trained, ("sgd", False, True)),
    "diloco plain": (4, diloco_across, (None,)),
    "diloco": (4, diloco_across, (True,)),
    "compressed": (4, compressed_across, ()),
    "sgd 2x3": (6, trained, ("sgd", True)),
    "adam 2x3": (6, trained, ("adam", True)),
    "scaler 2x3": (6, trained, ("sgd", True, True)),
}
WORLDS = Worlds(CASES, timeout=300)
results = WORLDS.results


# ---------------------------------------------------------------------- the reference (one process)


def reference(optimizer, world, scaled=False):
    """The global batch in one process: the mean of every rank's loss (the head as each rank uses it), clipped
    to ``CLIP``; with ``scaled``, step 1 skipped."""
    islands = ISLANDS[world]
    net = Net()
    opt = OPTIMIZERS[optimizer](net.parameters())
    grads, norms = [], []
    for t in range(STEPS):
        opt.zero_grad()
        sum(net.loss(*batch(r, t), r in islands[0]) for r in range(world)).div(world).backward()
        grads.append(grads_of(net))
        if scaled:
            if t != 1:
                opt.step()
            continue
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
    return {"grads": grads, "norms": norms, "params": [p.detach().clone() for p in net.parameters()],
            "state": opt.state_dict()}


def close(a, b, tol=TOL):
    return len(a) == len(b) and all((x - y).abs().max().item() <= tol for x, y in zip(a, b))


def same_state(got, want):
    """Two optimizer state dicts alike: the param groups exactly, every state tensor within ``TOL``."""
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, state in want["state"].items():
        assert sorted(got["state"][i]) == sorted(state)
        for key, value in state.items():
            theirs = got["state"][i][key]
            if isinstance(value, torch.Tensor):
                assert (theirs - value).abs().max().item() <= TOL, (i, key)
            else:
                assert theirs == value, (i, key)


def check_ownership(per_rank, world):
    """Rank j of every island owns the same parameters; an island's ranks own each parameter once, unevenly."""
    k = len(ISLANDS[world][0])
    by_place = {}
    for r in per_rank:
        by_place.setdefault(r["place"], []).append(r["owned"])
    assert sorted(by_place) == list(range(k))
    for owned in by_place.values():
        assert all(o == owned[0] for o in owned)
    owned = [by_place[j][0] for j in range(k)]
    assert sorted(i for o in owned for i in o) == list(range(8))
    assert len({len(o) for o in owned}) > 1  # uneven: the first Linear's weight alone is a third of the bytes
    for r in per_rank:  # the shard of the state this rank keeps is its owned parameters'
        assert r["shard"] == [i for i in r["owned"] if i not in (6, 7)]  # the unused head has no state


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("case, world", [("sgd", 4), ("adam", 4), ("sgd 2x3", 6), ("adam 2x3", 6)])
def test_gradients_sharded_inside_islands_train_as_one_process_on_the_global_batch(case, world):
    want = reference(case.split()[0], world)
    per_rank = results(case)
    check_ownership(per_rank, world)
    assert min(want["norms"]) > CLIP
    for r in per_rank:
        for step, (got, ref) in enumerate(zip(r["grads"], want["grads"])):
            for i, (g, w) in enumerate(zip(got, ref)):
                # .grad after backward(): the global mean on the owner, None on the island's other ranks, and
                # None everywhere for the head no rank uses (the head island 1 never uses is averaged with zeros).
                if i in r["owned"] and w is not None:
                    assert g is not None and (g - w).abs().max().item() <= TOL, (step, i)
                else:
                    assert g is None, (step, i)
        # opt.clip_grad_norm_() is the global norm: the owned norms summed over the island, after the sum across.
        assert max(abs(a - b) for a, b in zip(r["norms"], want["norms"])) <= TOL
        assert close(r["params"], want["params"])
        same_state(r["state"], want["state"])
    # Every rank of every island holds the same bits.
    for r in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0]["params"], r["params"]))


@pytest.mark.parametrize("case, world", [("scaler", 4), ("scaler 2x3", 6)])
def test_grad_scaler_skips_on_every_rank_of_every_island_where_one_gradient_of_one_rank_is_inf(case, world):
    want = reference("sgd", world, scaled=True)
    per_rank = results(case)
    last = per_rank[-1]
    # The inf went into body.0.weight (index 0) on the last rank, which does not own it.
    assert 0 not in last["owned"]
    for r in per_rank:
        assert r["scale"] == 2.0 ** 9
        assert close(r["params"], want["params"])
        same_state(r["state"], want["state"])


def test_sums_across_carry_only_the_owned_gradients_of_each_rank():
    sizes = [32, 8, 16, 2, 4, 1, 4, 2]
    for r in results("sgd"):
        owned = r["owned"]  # the unused head's travel as zeros, absent, as in synchronous training
        # Every step, in one pack: this rank's owned gradients and their presence and control flags, nothing else
        # (plain replicas inside would send a 1/k slice of every gradient, ZeRO-1 inside too).
        assert r["across"] == [(sum(sizes[i] for i in owned) + len(owned) + CONTROL_FLAGS) * 8] * STEPS


def test_sharded_state_inside_holds_the_global_mean_after_backward_and_skips_alike_with_grad_scaler():
    want = reference("sgd", 4)
    for r in results("zero1 sgd"):
        for got, ref in zip(r["grads"], want["grads"]):
            assert all((g is None) == (w is None) for g, w in zip(got, ref))
            assert close([g for g in got if g is not None], [w for w in ref if w is not None])
        assert max(abs(a - b) for a, b in zip(r["norms"], want["norms"])) <= TOL
        assert close(r["params"], want["params"])
    scaled = reference("sgd", 4, scaled=True)
    for r in results("zero1 scaler"):
        assert r["scale"] == 2.0 ** 9
        assert close(r["params"], scaled["params"])


def test_diloco_across_with_gradients_sharded_inside_trains_as_with_plain_replicas_inside():
    plain, sharded = results("diloco plain"), results("diloco")
    for (want, want_norms), (got, norms) in zip(plain, sharded):
        assert close(got, want)
        # Clipping inside an island: the island's norm, its owned parts summed over its ranks.
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) <= TOL
        assert min(want_norms) > CLIP


def test_compression_across_leaves_every_rank_of_every_island_bitwise_identical():
    per_rank = results("compressed")
    for params in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0], params))
    # And it trained: the compressed sums moved the parameters, near the uncompressed run.
    start = [p.detach() for p in Net().parameters()]
    assert not close(per_rank[0], start, tol=1e-6)
