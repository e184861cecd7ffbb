"""Local SGD and DiLoCo (``sync_every``, ``outer_optimizer``, ``local_warmup``).

Every multi-process check runs on each rank of one world (one launch per world
size) and compares against references computed inside the worker: torch's own
``PostLocalSGDOptimizer``, distopt's synchronous mode, and :func:`simulate`, a
single-process replay of every rank's replica and of the protocol (float64,
1e-10). The assertions live in the tests.
"""
import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import DistributedOptimizer
from distopt.modes.local_sgd import STATE_KEY

from _drift_outcome import checks_at_the_top, drift_outcome
from _worlds import Worlds

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


INNER = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}
OUTER = {
    None: None,
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    # The benchmark's: one fused kernel over the last-sync copies, the same update.
    "nesterov fused": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, fused=True),
    "sgd1": lambda ps: torch.optim.SGD(ps, lr=1.0),
    "half": lambda ps: torch.optim.SGD(ps, lr=0.5),
}


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def simulate(counts, sync_every, inner="sgd", outer=None, warmup=0, skips=frozenset(), freeze=None):
    """Every rank's replica in one process, and the protocol between them.

    Rank r runs ``counts[r]`` steps. The first ``warmup`` steps average gradients over
    the ranks still training; then each rank steps alone and, every ``sync_every``
    local steps (and once more when it runs out with steps not yet averaged), offers
    its pseudo-gradient ``anchor - param``. The k-th offer of every rank meets the
    others' k-th (collectives pair by order); the mean over those present moves the
    anchors (minus it, or the outer optimizer steps on it) and each of them takes
    the anchors. Rank r's inner step t is skipped (but counted) where ``(r, t)`` is in ``skips``.
    ``freeze``: ``(t, indices, ranks)``, those ranks freeze the parameters at ``indices`` before their
    step t; a frozen parameter that has not moved since the last sync offers nothing, and one that no rank
    offers has no mean (the outer optimizer skips it).

    Returns:
        ``(trace, final, final_state)``: ``trace[r][t]`` is rank r's parameters after its
        step t; ``final`` the parameters every rank ends a join block with (those of the
        ranks in the last round, all alike), and ``final_state`` the inner optimizer state
        it ends with: that of a rank that ran the longest (of those, the highest).
    """
    world = len(counts)
    models = [make_model() for _ in range(world)]
    opts = [INNER[inner](m.parameters()) for m in models]
    anchors = params_of(models[0])
    outer_opt = OUTER[outer](anchors) if outer else None
    trace = [[] for _ in range(world)]

    def pseudo_gradients(model):
        return [None if not p.requires_grad and not (a - p).any() else a - p.detach()
                for a, p in zip(anchors, model.parameters())]

    def program(r):
        model, opt, since = models[r], opts[r], 0
        for t in range(counts[r]):
            if freeze is not None and t == freeze[0] and r in freeze[2]:
                for i in freeze[1]:
                    list(model.parameters())[i].requires_grad_(False)
            opt.zero_grad()
            loss_of(model, *batch(r, t)).backward()
            if t < warmup:
                mean = yield "grad", [p.grad.clone() for p in model.parameters()]
                for p, g in zip(model.parameters(), mean):
                    p.grad = g
                if (r, t) not in skips:
                    opt.step()
                if t == warmup - 1:
                    with torch.no_grad():
                        for a, p in zip(anchors, model.parameters()):
                            a.copy_(p)
            else:
                if (r, t) not in skips:
                    opt.step()
                since += 1
                if since == sync_every:
                    since = 0
                    yield "delta", pseudo_gradients(model)
            trace[r].append(params_of(model))
        if since:
            yield "delta", pseudo_gradients(model)

    programs = [program(r) for r in range(world)]
    offers = {}
    for r, prog in enumerate(programs):
        offer = next(prog, None)
        if offer is not None:
            offers[r] = offer
    last = world - 1
    while offers:
        kinds = {kind for kind, _ in offers.values()}
        assert len(kinds) == 1, "the simulation paired a gradient round with an exchange"
        kind = kinds.pop()
        present = sorted(offers)
        sent = [[offers[r][1][i] for r in present if offers[r][1][i] is not None] for i in range(len(anchors))]
        mean = [sum(values) / len(present) if values else None for values in sent]
        reply = mean
        if kind == "delta":
            with torch.no_grad():
                if outer_opt is None:
                    for a, m in zip(anchors, mean):
                        if m is not None:
                            a.sub_(m)
                else:
                    for a, m in zip(anchors, mean):
                        a.grad = m
                    outer_opt.step()
                for r in present:
                    for p, a in zip(models[r].parameters(), anchors):
                        p.copy_(a)
            reply = None
        last = present[-1]
        offers = {}
        for r in present:
            try:
                offers[r] = programs[r].send(reply)
            except StopIteration:
                pass
    longest = max(range(world), key=lambda r: (counts[r], r))
    return trace, params_of(models[last]), inner_state(opts[longest])


def inner_state(optimizer):
    """The inner optimizer's state, in parameter order: each tensor, and each number as a tensor."""
    return [torch.as_tensor(state[key]).clone() for p in optimizer.param_groups[0]["params"]
            for state in [optimizer.state.get(p, {})] for key in sorted(state)]


# ---------------------------------------------------------------------- checks (run on every rank)


def everyone_equal(tensors):
    mine = [t.detach().clone() for t in tensors]
    return all(len(o) == len(mine) and all(torch.equal(a, b) for a, b in zip(mine, o))
               for o in distopt.all_gather_object(mine))


def train_against_simulation(steps, sync_every, inner="sgd", outer=None, warmup=0, compression=None,
                             threshold=256):
    """Train ``steps`` steps; after each, compare with the simulation and with the other ranks."""
    rank = dist.get_rank()
    model = make_model(seed=rank)  # the construction broadcast aligns them
    opt = DistributedOptimizer(INNER[inner](model.parameters()), sync_every=sync_every,
                               outer_optimizer=OUTER[outer], local_warmup=warmup, compression=compression,
                               pack_threshold=threshold)
    trace, _, _ = simulate([steps] * dist.get_world_size(), sync_every, inner, outer, warmup)
    diffs, identical, packs, local_grads_exact = [], [], [], True
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        if t >= warmup:  # between syncs .grad must be this rank's own gradient
            expected = torch.autograd.grad(loss_of(model, x, y), list(model.parameters()))
        loss_of(model, x, y).backward()
        if t >= warmup:
            local_grads_exact &= all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
        opt.step()
        packs.append(opt.stats.packs)
        diffs.append(max_diff(params_of(model), trace[rank][t]))
        identical.append(everyone_equal(model.parameters()))
    extra = opt.stats.extra_state_bytes
    opt.close()
    return {"diffs": diffs, "identical": identical, "packs": packs, "local_grads_exact": local_grads_exact,
            "extra": extra, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def one_step_diloco_equals_synchronous_sgd(steps):
    """H=1 with an outer SGD at lr 1 (no momentum) against distopt's synchronous mode, step by step."""
    rank = dist.get_rank()
    models = [make_model(seed=rank), make_model(seed=rank)]  # the root's pair is broadcast: equal starts
    opts = [DistributedOptimizer(INNER["sgd"](models[0].parameters())),
            DistributedOptimizer(INNER["sgd"](models[1].parameters()), sync_every=1, outer_optimizer=OUTER["sgd1"])]
    diffs = []
    for t in range(steps):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()
        diffs.append(max_diff(params_of(models[0]), params_of(models[1])))
    for opt in opts:
        opt.close()
    return diffs


def averaging_equals_torch_post_local_sgd(steps, sync_every):
    """Plain averaging against torch's PostLocalSGDOptimizer + PeriodicModelAverager on the same data."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    rank = dist.get_rank()
    theirs_model, mine_model = make_model(), make_model(seed=rank)
    # torch's averager counts steps from 0 and averages at its warm-up step itself: warm-up H-1
    # makes it average after every H-th step, as distopt does.
    theirs = PostLocalSGDOptimizer(INNER["momentum"](theirs_model.parameters()),
                                   PeriodicModelAverager(period=sync_every, warmup_steps=sync_every - 1))
    mine = DistributedOptimizer(INNER["momentum"](mine_model.parameters()), sync_every=sync_every)
    diffs, identical = [], []
    for t in range(steps):
        for model, opt in ((theirs_model, theirs), (mine_model, mine)):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()
        diffs.append(max_diff(params_of(mine_model), params_of(theirs_model)))
        identical.append(everyone_equal(mine_model.parameters()))
    mine.close()
    return {"diffs": diffs, "identical": identical}


def pseudo_gradient_sign(sync_every):
    """Outer SGD at lr 0.5: the sync lands halfway between the last-sync parameters and the mean of the ranks'."""
    rank = dist.get_rank()
    model = make_model(seed=rank)
    opt = DistributedOptimizer(INNER["sgd"](model.parameters()), sync_every=sync_every,
                               outer_optimizer=OUTER["half"])
    local = []
    opt.register_step_post_hook(lambda *_: local.__setitem__(slice(None), params_of(model)))  # before the sync
    anchor = params_of(model)
    results = []
    for t in range(3 * sync_every):
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
        if (t + 1) % sync_every == 0:
            everyone = distopt.all_gather_object(local)
            mean = [sum(ps[i] for ps in everyone) / len(everyone) for i in range(len(local))]
            halfway = [(a + m) / 2 for a, m in zip(anchor, mean)]
            overshoot = [a - (m - a) / 2 for a, m in zip(anchor, mean)]  # the opposite sign
            results.append((max_diff(params_of(model), halfway), max_diff(params_of(model), overshoot)))
            anchor = params_of(model)
    opt.close()
    return results


def collectives_per_step(steps, sync_every, outer):
    """stats.packs/bytes summed over steps: local SGD against synchronous training of the same model."""
    rank = dist.get_rank()
    out = {}
    for name, kwargs in (("sync", {}), ("local", {"sync_every": sync_every, "outer_optimizer": OUTER[outer]})):
        model = make_model()
        # one pack per parameter: the same plan whatever order the gradients arrive in
        opt = DistributedOptimizer(INNER["momentum"](model.parameters()), pack_threshold=0, **kwargs)
        packs, nbytes = [], []
        for t in range(steps):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()
            packs.append(opt.stats.packs)
            nbytes.append(opt.stats.bytes)
        out[name] = {"packs": packs, "bytes": nbytes, "plan": len(opt._engine.packs),
                     "extra": opt.stats.extra_state_bytes}
        opt.close()
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def hooks_per_backward(steps, sync_every, warmup):
    """How many gradient hooks each backward pass meets: the warm-up's reduce, local steps' would not."""
    rank = dist.get_rank()
    model = make_model()
    opt = DistributedOptimizer(INNER["momentum"](model.parameters()), sync_every=sync_every,
                               outer_optimizer=OUTER["nesterov"], local_warmup=warmup)
    hooked = []
    for t in range(steps):
        opt.zero_grad()
        hooked.append(len(opt._engine.handles))
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
    opt.close()
    return {"hooked": hooked, "params": len(list(model.parameters()))}


def checkpoint_round_trip(steps, cut, sync_every, warmup):
    """Save every rank's model and optimizer mid-period, load into fresh ones, finish: the same bits."""
    rank = dist.get_rank()

    def build(seed):
        model = make_model(seed)
        return model, DistributedOptimizer(INNER["momentum"](model.parameters()), sync_every=sync_every,
                                           outer_optimizer=OUTER["nesterov"], local_warmup=warmup)

    def run(model, opt, start, stop):
        for t in range(start, stop):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()

    model, opt = build(0)
    run(model, opt, 0, steps)
    straight = params_of(model)
    opt.close()

    model, opt = build(0)
    run(model, opt, 0, cut)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    saved_keys = sorted(opt.state_dict())
    opt.close()
    buffer.seek(0)
    saved = torch.load(buffer)
    model, opt = build(seed=100 + rank)  # different weights: everything must come from the checkpoint
    model.load_state_dict(saved["model"])  # after the wrapper: its construction broadcast would overwrite it
    opt.load_state_dict(saved["opt"])
    run(model, opt, cut, steps)
    resumed = params_of(model)
    opt.close()
    plain = torch.optim.SGD(make_model().parameters(), lr=0.05, momentum=0.9)
    plain.load_state_dict(saved["opt"])  # the extra key is ignored by a plain torch optimizer
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(straight, resumed)), "keys": saved_keys,
            "plain_momentum": sorted(plain.state[plain.param_groups[0]["params"][0]])}


def train_uneven(counts, sync_every, inner="sgd", outer=None, warmup=0, compression=None, check_every=100,
                 stall_timeout=None):
    """``with opt.join():`` around a loop of ``counts[rank]`` steps."""
    rank = dist.get_rank()
    model = make_model(seed=rank)
    opt = DistributedOptimizer(INNER[inner](model.parameters()), sync_every=sync_every,
                               outer_optimizer=OUTER[outer], local_warmup=warmup, compression=compression,
                               pack_threshold=256, check_every=check_every, stall_timeout=stall_timeout)
    with opt.join():
        for t in range(counts[rank]):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()
    mode = opt._mode
    anchors = [a for _, a in mode._pairs(opt._context)]
    outer_state = [v for s in (mode.outer.state.values() if mode.outer else []) for v in s.values()
                   if torch.is_tensor(v)]
    identical = everyone_equal(list(model.parameters()) + anchors + outer_state)
    _, final, final_state = simulate(counts, sync_every, inner, outer, warmup)
    state = inner_state(opt.optimizer)
    result = {"identical": identical, "diff": max_diff(params_of(model), final), "steps": opt._engine.steps,
              "since_sync": mode.since_sync, "anchors_are_params": max_diff(anchors, params_of(model)),
              "inner_identical": everyone_equal(state),
              "inner_steps": sorted({float(v) for v in state if v.dim() == 0}),
              "inner_diff": max_diff(state, final_state) if len(state) == len(final_state) else float("inf"),
              "drift_checks": (opt.stats.drift_checks, opt.stats.drift_step)}
    opt.close()
    return result


FROZEN = (4, 5)  # the last layer's weight and bias


def freeze_mid_training(steps, sync_every, freeze_at, ranks, outer="nesterov"):
    """DiLoCo whose last layer ``ranks`` freeze (``requires_grad_(False)``) before step ``freeze_at``, right after
    a sync; after every step: against the simulation, how far the frozen layer has moved, and the ranks alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=rank)
    opt = DistributedOptimizer(INNER["momentum"](model.parameters()), sync_every=sync_every,
                               outer_optimizer=OUTER[outer], pack_threshold=256, stall_timeout=30)
    trace, _, _ = simulate([steps] * world, sync_every, "momentum", outer, freeze=(freeze_at, FROZEN, ranks))
    layer = [list(model.parameters())[i] for i in FROZEN]
    diffs, moved, identical = [], [], []
    for t in range(steps):
        if t == freeze_at:
            at_freeze = [p.detach().clone() for p in layer]
            if rank in ranks:
                for p in layer:
                    p.requires_grad_(False)
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
        diffs.append(max_diff(params_of(model), trace[rank][t]))
        if t >= freeze_at:
            moved.append(max_diff(layer, at_freeze))
        identical.append(everyone_equal(model.parameters()))
    opt.close()
    return {"diffs": diffs, "moved": moved, "identical": identical}


def check_drift_inside_join(counts, sync_every, outer=None):
    """``opt.check_drift()`` after every step of a loop of ``counts[rank]`` steps inside ``with opt.join():``,
    each outcome noted and training going on: "ran", or the RuntimeError it raised at once, "between" (between
    two syncs) or "joined" (a sync's flags said that a rank ran out of data)."""
    rank = dist.get_rank()
    model = make_model(seed=rank)
    opt = DistributedOptimizer(INNER["sgd"](model.parameters()), sync_every=sync_every, outer_optimizer=OUTER[outer],
                               pack_threshold=256, check_every=0, stall_timeout=10)
    outcomes = []
    with opt.join():
        for t in range(counts[rank]):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()
            outcomes.append(drift_outcome(opt))
    _, final, _ = simulate(counts, sync_every, "sgd", outer)
    result = {"outcomes": outcomes, "identical": everyone_equal(model.parameters()),
              "diff": max_diff(params_of(model), final)}
    opt.close()
    return result


def check_drift_right_after_syncs_inside_join(counts, sync_every, outer=None):
    """``opt.check_drift()`` at the top of every step that follows a sync, inside join(): with ``counts`` uneven,
    a rank whose last step synced has nothing more to send and waits in the shadow of the next exchange, which the
    sync's flags could not tell (an error on every rank, at once); with equal counts the checks (each a probe
    round) leave the loop bitwise where it ends without them."""
    rank = dist.get_rank()
    finals = []
    for every in (sync_every, None):
        model = make_model(seed=rank)
        opt = DistributedOptimizer(INNER["momentum"](model.parameters()), sync_every=sync_every,
                                   outer_optimizer=OUTER[outer], pack_threshold=256, check_every=0, stall_timeout=10)

        def train_step(t):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()

        outcome = checks_at_the_top(opt, counts[rank], train_step, every)
        finals.append(([p.detach().clone() for p in model.parameters()], outcome))
        opt.close()
    (with_checks, outcome), (without, _) = finals
    return dict(outcome, bitwise=all(torch.equal(a, b) for a, b in zip(with_checks, without)))


def state_of(opt):
    """The local-SGD mode's state on this rank: step counts, anchors and outer optimizer state, in order."""
    mode = opt._mode
    outer = [v for s in (mode.outer.state.values() if mode.outer else []) for v in s.values() if torch.is_tensor(v)]
    return {"steps": opt._engine.steps, "since_sync": mode.since_sync, "anchors": [a for _, a in mode._pairs(opt._context)],
            "outer": outer, "layout": mode.outer_layout(opt._context)}


def root_only_resume(cut, grow, steps=9, sync_every=3):
    """Only the root loads a DiLoCo checkpoint (with ``grow``, taken after add_param_group, into a wrapper
    built with the final param groups); broadcast_parameters() and broadcast_optimizer_state() then give
    every rank its state."""
    rank = dist.get_rank()

    def run(model, opt, start, stop, late=False):
        for t in range(start, stop):
            if t == 2 and late:
                opt.add_param_group({"params": list(model[4].parameters())})
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()

    def first_layers(model):
        return list(model[0].parameters()) + list(model[2].parameters())

    model = make_model()
    opt = DistributedOptimizer(INNER["sgd"](first_layers(model) if grow else model.parameters()),
                               sync_every=sync_every, outer_optimizer=OUTER["nesterov"], stall_timeout=30)
    run(model, opt, 0, cut, late=grow)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    run(model, opt, cut, steps)
    straight = params_of(model)
    opt.close()
    model = make_model(seed=10 + rank)
    groups = [{"params": first_layers(model)}, {"params": model[4].parameters()}] if grow else model.parameters()
    opt = DistributedOptimizer(INNER["sgd"](groups), sync_every=sync_every, outer_optimizer=OUTER["nesterov"],
                               stall_timeout=30)
    if rank == 0:
        buffer.seek(0)
        saved = torch.load(buffer)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    opt.broadcast_parameters()
    opt.broadcast_optimizer_state()
    mine = state_of(opt)
    counts = distopt.all_gather_object((mine["steps"], mine["since_sync"], mine["layout"]))
    identical_state = everyone_equal(mine["anchors"] + mine["outer"] + list(model.parameters()))
    run(model, opt, cut, steps)
    result = {"counts": counts, "identical_state": identical_state,
              "identical_after": everyone_equal(model.parameters()), "diff": max_diff(params_of(model), straight)}
    opt.close()
    return result


def scaled_training(steps, sync_every, infs, warmup=0, unscale=False):
    """torch.amp.GradScaler with an inf in rank r's batch at step t for each (r, t) in ``infs``: against
    the simulation with those steps skipped (on every rank during the warm-up, where gradients are averaged)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=rank)
    opt = DistributedOptimizer(INNER["momentum"](model.parameters()), sync_every=sync_every, local_warmup=warmup,
                               stall_timeout=30)  # ranks whose syncs drift apart fail in time
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skips = {(r, t) for _, t in infs if t < warmup for r in range(world)} | {i for i in infs if i[1] >= warmup}
    trace, _, _ = simulate([steps] * world, sync_every, "momentum", None, warmup, skips=skips)
    counts, diffs, identical = [], [], []
    for t in range(steps):
        x, y = batch(rank, t)
        if (rank, t) in infs:
            x[0, 0] = float("inf")  # an overflow on this rank only
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        counts.append((opt._engine.steps, opt._mode.since_sync))
        diffs.append(max_diff(params_of(model), trace[rank][t]))
        identical.append(everyone_equal(model.parameters()))
    opt.close()
    return {"counts": counts, "diffs": diffs, "identical": identical, "scale": scaler.get_scale()}


def outer_optimizer_on_one_rank():
    """Rank 0 passes sync_every=1 with an outer optimizer (DiLoCo), rank 1 neither: the error names the argument."""
    kwargs = {"sync_every": 1, "outer_optimizer": OUTER["sgd1"]} if dist.get_rank() == 0 else {}
    try:
        DistributedOptimizer(INNER["sgd"](make_model().parameters()), stall_timeout=30, **kwargs).close()
    except ValueError as exc:
        return str(exc)
    return None


def drift_at_syncs(steps, sync_every):
    """DiLoCo under a drift check due at every step (check_every=1): it runs only right after the syncs;
    rank 1 moves a parameter between two syncs (its own business: the next sync averages it in);
    ``check_drift()`` between two syncs compares the last-sync copies, and a copy moved on one rank is drift."""
    rank = dist.get_rank()
    model = make_model()
    opt = DistributedOptimizer(INNER["momentum"](model.parameters()), sync_every=sync_every,
                               outer_optimizer=OUTER["nesterov"], check_every=1,
                               named_parameters=model.named_parameters(), stall_timeout=30)
    checked = []
    for t in range(steps):
        if t == 1 and rank == 1:
            with torch.no_grad():
                model[0].weight.add_(1e-3)
        x, y = batch(rank, t)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        checked.append((opt.stats.drift_checks, opt.stats.drift_step, opt.stats.drifted))
    between = opt.check_drift()
    if rank == 1:
        with torch.no_grad():
            opt.state_dict()[STATE_KEY]["anchors"][0].add_(1e-3)  # the last-sync copy of 0.weight itself
    try:
        opt.check_drift()
        error = None
    except distopt.DriftError as exc:
        error = str(exc)
    opt.close()
    return {"checked": checked, "between": (between.what, len(between.drifted)), "error": error}


# (world, check, args, kwargs)
def sync_now_before_a_save(sync_every, outer):
    """Between two syncs, ``sync_now()`` leaves every rank with the same parameters, and the next sync comes
    ``sync_every`` steps later; right after it, a second call sends nothing."""
    rank = dist.get_rank()
    model = make_model()
    factory = None if outer is None else (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=sync_every,
                               outer_optimizer=factory)
    for step in range(sync_every + 1):  # one step past a sync: the replicas differ
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    before = everyone_equal(params_of(model))
    opt.sync_now()
    after = everyone_equal(params_of(model))
    sent = opt.stats.packs
    opt.sync_now()  # nothing since the last sync: nothing is sent
    again = opt.stats.packs
    exchanges = []
    for step in range(sync_every + 1, 3 * sync_every + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        exchanges.append(opt.stats.packs > 0)
    opt.close()
    return {"before": before, "after": after, "sent": sent, "again": again, "exchanges": exchanges}


def sync_now_in_streaming():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=4, sync_fragments=2)
    try:
        opt.sync_now()
    except RuntimeError as exc:
        return str(exc)
    finally:
        opt.close()
    return None


CASES = {
    "plain H=4": (2, train_against_simulation, (12, 4), {"inner": "momentum"}),
    "diloco H=3": (2, train_against_simulation, (12, 3), {"inner": "adam", "outer": "nesterov"}),
    "diloco H=4, world 3": (3, train_against_simulation, (12, 4), {"outer": "nesterov"}),
    "diloco fused outer": (2, train_against_simulation, (12, 4), {"inner": "adam", "outer": "nesterov fused"}),
    "warm-up": (2, train_against_simulation, (15, 4), {"inner": "momentum", "outer": "nesterov", "warmup": 3}),
    "compression": (2, train_against_simulation, (12, 4), {"outer": "nesterov", "compression": "bf16"}),
    "H=1 outer lr 1": (2, one_step_diloco_equals_synchronous_sgd, (8,), {}),
    "torch post-local SGD": (2, averaging_equals_torch_post_local_sgd, (20, 4), {}),
    "sign": (2, pseudo_gradient_sign, (3,), {}),
    "collectives": (2, collectives_per_step, (16, 4, "nesterov"), {}),
    "hooks": (2, hooks_per_backward, (7, 3, 2), {}),
    "checkpoint": (2, checkpoint_round_trip, (14, 7, 4, 2), {}),
    "join plain": (2, train_uneven, ([6, 11], 4), {"inner": "momentum"}),
    "join diloco, root last": (2, train_uneven, ([11, 5], 4), {"outer": "nesterov"}),
    "join equal counts off the period": (2, train_uneven, ([10, 10], 4), {"outer": "nesterov"}),
    "join during warm-up": (2, train_uneven, ([2, 9], 3), {"outer": "nesterov", "warmup": 4}),
    "join, a rank without data": (3, train_uneven, ([5, 0, 9], 2), {"outer": "nesterov"}),
    "join compression": (2, train_uneven, ([7, 4], 3), {"compression": "bf16"}),
    # the ranks' last local steps meet in one final exchange: the one that ran longest must win
    "join adam, last exchanges meet, 6/5": (2, train_uneven, ([6, 5], 4), {"inner": "adam"}),
    "join adam, last exchanges meet, 7/5": (2, train_uneven, ([7, 5], 4), {"inner": "adam"}),
    "join adam, last exchanges meet, world 3": (3, train_uneven, ([5, 7, 6], 4), {"inner": "adam"}),
    # a drift check due while a rank runs out of data: rank 1 sends its last steps at the others' sync 15 (and
    # rank 2 at 20), whose flags must tell them that it leaves; at 100 (the default) with plain averaging
    "join under a drift check at every step, world 3": (3, train_uneven, ([20, 12, 16], 5),
                                                        {"outer": "nesterov", "check_every": 1, "stall_timeout": 10}),
    "join under the default drift check": (2, train_uneven, ([104, 99], 4), {"stall_timeout": 10}),
    "check_drift() inside join, world 3": (3, check_drift_inside_join, ([20, 12, 16], 5), {"outer": "nesterov"}),
    "check_drift() right after a sync, a rank just out of data": (2, check_drift_right_after_syncs_inside_join,
                                                                  ([7, 4], 2), {"outer": "nesterov"}),
    "check_drift() right after a sync, equal counts": (2, check_drift_right_after_syncs_inside_join, ([6, 6], 2),
                                                       {"outer": "nesterov"}),
    "frozen mid-training": (2, freeze_mid_training, (15, 3, 6, (0, 1)), {}),
    "frozen mid-training, world 3": (3, freeze_mid_training, (12, 4, 4, (0, 1, 2)), {}),
    "frozen on one rank only": (2, freeze_mid_training, (15, 3, 6, (1,)), {}),
    "root-only load at a sync": (2, root_only_resume, (6, False), {}),
    "root-only load mid-period, after add_param_group": (2, root_only_resume, (7, True), {}),
    "settings differ": (2, outer_optimizer_on_one_rank, (), {}),
    "drift at syncs": (2, drift_at_syncs, (7, 3), {}),
    "sync_now, averaging": (2, sync_now_before_a_save, (3, None), {}),
    "sync_now, DiLoCo": (2, sync_now_before_a_save, (3, "nesterov"), {}),
    "sync_now, streaming": (2, sync_now_in_streaming, (), {}),
    # last: before the fix, these ranks' syncs drift apart and leave the world out of step
    "scaler, inf on one rank": (2, scaled_training, (9, 3, {(1, 0), (1, 4)}), {}),
    "scaler after unscale_, warm-up": (2, scaled_training, (9, 2, {(1, 0), (0, 4)}), {"warmup": 2, "unscale": True}),
}

WORLDS = Worlds(CASES, timeout=280)
results = WORLDS.results


# ---------------------------------------------------------------------- the tests


def test_only_the_warm_ups_backward_passes_meet_gradient_hooks(no_leftover_processes):
    # A hook that finds nothing to do still costs each backward pass a call into Python per parameter.
    for r in results("hooks"):
        assert r["hooked"] == [r["params"]] * 2 + [0] * 5, r


def test_the_drift_check_compares_only_right_after_syncs_and_a_ranks_own_steps_are_not_drift(no_leftover_processes):
    for r in results("drift at syncs"):
        # Due at every step, run at the syncs (steps 3 and 6) alone; the move between syncs was averaged in.
        assert r["checked"] == [(0, 0, 0), (0, 0, 0), (1, 3, 0), (1, 3, 0), (1, 3, 0), (2, 6, 0), (2, 6, 0)]
        what, drifted = r["between"]
        assert what.startswith("the parameters' last-sync copies, the outer optimizer's state") and drifted == 0
        assert "last-sync copy of '0.weight' differs between ranks by 0.001" in r["error"]
        assert "called as opt.check_drift() after step 7" in r["error"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sync_now, averaging", "sync_now, DiLoCo"])
def test_sync_now_leaves_every_rank_with_the_same_parameters_and_restarts_the_period(name, no_leftover_processes):
    for r in WORLDS.results(name):
        assert not r["before"] and r["after"], r
        assert r["sent"] > 0 and r["again"] == 0, r
        # sync_every=3: the next syncs come 3 and 6 steps after sync_now()
        assert r["exchanges"] == [False, False, True, False, False, True], r


def test_sync_now_in_streaming_says_why_not_and_what_the_checkpoint_holds(no_leftover_processes):
    for message in WORLDS.results("sync_now, streaming"):
        assert message is not None and "sync_now() is not available in streaming" in message
        assert "sync_fragments=2" in message


@pytest.mark.parametrize("name", ["plain H=4", "diloco H=3", "diloco H=4, world 3", "warm-up", "diloco fused outer"])
def test_training_matches_the_single_process_simulation_after_every_step(name, no_leftover_processes):
    steps, sync_every = CASES[name][2]
    warmup = CASES[name][3].get("warmup", 0)
    for r in results(name):
        assert max(r["diffs"]) < TOL, r["diffs"]
        assert r["local_grads_exact"]
        syncs = [t for t in range(steps) if t < warmup or (t + 1 - warmup) % sync_every == 0]
        # (3) bitwise identical after every sync (and warm-up step), and apart in between
        assert all(r["identical"][t] for t in syncs), r["identical"]
        assert not any(r["identical"][t] for t in range(steps) if t not in syncs), r["identical"]
        # communication happens exactly at those steps
        assert [t for t in range(steps) if r["packs"][t]] == syncs


@pytest.mark.timeout(300)
def test_one_step_diloco_with_outer_sgd_at_lr_1_is_synchronous_sgd(no_leftover_processes):
    for diffs in results("H=1 outer lr 1"):
        assert max(diffs) < TOL, diffs


@pytest.mark.timeout(300)
def test_plain_averaging_equals_torch_post_local_sgd_optimizer(no_leftover_processes):
    for r in results("torch post-local SGD"):
        assert len(r["diffs"]) == 20 and max(r["diffs"]) < TOL, r["diffs"]
        # not vacuous: the ranks train apart between the syncs, after the 4th, 8th, ... step
        assert r["identical"] == [(t + 1) % 4 == 0 for t in range(20)]


@pytest.mark.timeout(300)
def test_the_pseudo_gradient_points_from_the_local_parameters_back_to_the_last_sync(no_leftover_processes):
    for syncs in results("sign"):
        assert len(syncs) == 3
        for halfway, overshoot in syncs:
            assert halfway < TOL and overshoot > 1e-4, syncs


@pytest.mark.timeout(300)
def test_local_sgd_sends_one_in_h_of_synchronous_training_and_reports_its_memory(no_leftover_processes):
    for r in results("collectives"):
        sync, local = r["sync"], r["local"]
        assert local["plan"] == sync["plan"] > 1
        assert all(p == sync["plan"] for p in sync["packs"])
        assert local["packs"] == [sync["plan"] if (t + 1) % 4 == 0 else 0 for t in range(16)]
        assert sum(local["packs"]) * 4 == sum(sync["packs"])
        assert sum(local["bytes"]) * 4 == sum(sync["bytes"])
        assert sync["extra"] == 0
        assert local["extra"] == 2 * r["param_bytes"]  # the last-sync copy and the outer momentum


@pytest.mark.timeout(300)
def test_compressed_pseudo_gradients_keep_the_ranks_identical_at_every_sync(no_leftover_processes):
    for r in results("compression"):
        assert all(r["identical"][t] for t in (3, 7, 11))
        assert 0 < max(r["diffs"]) < 2e-2, r["diffs"]  # rounded, so not exact, but close


@pytest.mark.timeout(300)
def test_a_checkpoint_taken_mid_period_resumes_bitwise(no_leftover_processes):
    for r in results("checkpoint"):
        assert r["bitwise"]
        assert r["keys"] == ["distopt_local_sgd", "param_groups", "state"]
        assert r["plain_momentum"] == ["momentum_buffer"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[1] is train_uneven and "compression" not in n])
def test_join_with_uneven_batches_ends_identical_and_follows_the_protocol(name, no_leftover_processes):
    counts = CASES[name][2][0]
    for r in results(name):
        assert r["identical"], r
        assert r["diff"] < TOL, r
        assert r["steps"] == max(counts)
        assert r["since_sync"] == 0
        assert r["anchors_are_params"] == 0.0
        if len(set(counts)) > 1:  # the ranks stopped apart: the inner state of a rank that ran longest, everywhere
            assert r["inner_identical"], r
            assert r["inner_diff"] < TOL, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, checks", [("join under a drift check at every step, world 3", (2, 10)),
                                          ("join under the default drift check", (0, 0))])
def test_a_drift_check_due_after_a_rank_ran_out_of_data_is_skipped_on_every_rank_and_training_ends_identical(
        name, checks, no_leftover_processes):
    # Before: the others learned that a rank had run out only from a later sync's flags, started the check's
    # all-reduce while it waited in the exchange it owed, and every rank failed with a StallError. Now a
    # sync whose flags say that a rank contributes for the last time, or not at all, is followed by no check:
    # checks at the syncs 5 and 10 only (none at 15 and 20), and none at 100 (rank 1 sent its last steps there).
    for r in results(name):
        assert r["drift_checks"] == checks, r
        assert r["identical"] and r["diff"] < TOL and r["since_sync"] == 0, r


@pytest.mark.timeout(300)
def test_check_drift_inside_join_runs_right_after_syncs_every_rank_trains_on_and_raises_at_once_elsewhere(
        no_leftover_processes):
    counts, every = CASES["check_drift() inside join, world 3"][2]
    for rank, r in enumerate(results("check_drift() inside join, world 3")):
        # between two syncs no round says whether a rank has joined: an error at once on every rank; at the
        # syncs 5 and 10 every rank trains on; the syncs 15 and 20 say that rank 1, then rank 2, ran out
        assert r["outcomes"] == ["between" if t % every else "ran" if t <= min(counts) else "joined"
                                 for t in range(1, counts[rank] + 1)], r
        assert r["identical"] and r["diff"] < TOL, r  # the calls changed nothing; training went on


def test_check_drift_right_after_a_sync_inside_join_raises_at_once_where_a_rank_ran_out_at_that_sync(
        no_leftover_processes):
    # Rank 1's last step synced (step 4): it has nothing left to send and shadows rank 0's next exchange, which
    # rank 0's check at the top of step 5 met before: both waited for the stall timeout.
    trainer, joined = results("check_drift() right after a sync, a rank just out of data")
    assert trainer["checks"] == 1 and trainer["seconds"] < 8, trainer  # after the sync at step 2 every rank trained
    assert trainer["error"].startswith("check_drift() was called inside a join block after a rank ran out of data"), \
        trainer
    assert joined["seconds"] < 8 and "rank 0 is gone" in joined["error"] and trainer["error"] in joined["error"], \
        joined
    for r in results("check_drift() right after a sync, equal counts"):
        assert r["error"] is None and r["checks"] == 2 and r["bitwise"], r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["frozen mid-training", "frozen mid-training, world 3"])
def test_a_parameter_frozen_on_every_rank_mid_training_is_not_moved_by_the_outer_optimizer(name, no_leftover_processes):
    steps, every, freeze_at, _ = CASES[name][2]
    for r in results(name):
        # Before: its zero pseudo-gradient stayed in the exchange and the outer Nesterov momentum moved it on.
        assert r["moved"] == [0.0] * (steps - freeze_at), r["moved"]
        assert max(r["diffs"]) < TOL, r["diffs"]
        assert all(r["identical"][t] for t in range(every - 1, steps, every)), r["identical"]


@pytest.mark.timeout(300)
def test_a_parameter_frozen_on_some_ranks_only_is_averaged_with_their_zeros_alike_on_every_rank(
        no_leftover_processes):
    steps, every, _, _ = CASES["frozen on one rank only"][2]
    for r in results("frozen on one rank only"):
        assert max(r["diffs"]) < TOL, r["diffs"]
        assert all(r["identical"][t] for t in range(every - 1, steps, every)), r["identical"]
        assert max(r["moved"]) > 1e-3  # not vacuous: rank 1's frozen copy is still moved by rank 0's progress


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in CASES if "last exchanges meet" in n])
def test_join_whose_last_exchanges_meet_ends_with_the_longest_ranks_inner_state_and_step_count(
        name, no_leftover_processes):
    counts = CASES[name][2][0]
    for r in results(name):
        assert r["steps"] == max(counts), r
        assert r["inner_steps"] == [max(counts)], r  # Adam's step, in the state of every parameter
        assert r["inner_identical"] and r["identical"], r
        assert r["inner_diff"] < TOL and r["diff"] < TOL, r


@pytest.mark.timeout(300)
def test_join_with_compression_ends_identical(no_leftover_processes):
    for r in results("join compression"):
        assert r["identical"], r
        assert r["diff"] < 2e-2, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["root-only load at a sync", "root-only load mid-period, after add_param_group"])
def test_broadcast_optimizer_state_gives_every_rank_the_roots_local_sgd_state(name, no_leftover_processes):
    cut, grow = CASES[name][2]
    layout = [[0, 1, 2, 3], [4, 5]] if grow else [[0, 1, 2, 3, 4, 5]]
    for r in results(name):
        # the step count, the steps since the last sync and the outer groups are the root's on every rank
        assert r["counts"] == [(cut, cut % 3, layout)] * 2, r
        assert r["identical_state"] and r["identical_after"], r
        if cut % 3 == 0:  # after a sync every rank had the root's state: as if never interrupted
            assert r["diff"] == 0.0, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["scaler, inf on one rank", "scaler after unscale_, warm-up"])
def test_a_gradscaler_inf_on_one_rank_skips_its_step_there_and_keeps_the_sync_schedule(name, no_leftover_processes):
    steps, sync_every, _ = CASES[name][2]
    warmup = CASES[name][3].get("warmup", 0)
    (r0, r1) = results(name)
    assert r0["counts"] == r1["counts"] == [(t + 1, 0 if t < warmup else (t + 1 - warmup) % sync_every)
                                            for t in range(steps)]
    for r in (r0, r1):
        assert max(r["diffs"]) < TOL, r["diffs"]
        assert all(r["identical"][t] for t in range(steps) if t < warmup or (t + 1 - warmup) % sync_every == 0)
    assert r0["scale"] != r1["scale"]  # each rank's scaler saw its own inf


@pytest.mark.timeout(300)
def test_ranks_that_differ_in_outer_optimizer_are_told_the_argument_not_the_mode(no_leftover_processes):
    for error in results("settings differ"):
        assert "different outer_optimizer on different ranks (rank 0: True, rank 1: False)" in error, error


# ---------------------------------------------------------------------- one process


def test_plain_averaging_in_one_process_is_bitwise_the_inner_optimizer():
    a, b = make_model(), make_model()
    plain = INNER["momentum"](a.parameters())
    wrapped = DistributedOptimizer(INNER["momentum"](b.parameters()), sync_every=4)
    for t in range(9):
        for model, opt in ((a, plain), (b, wrapped)):
            opt.zero_grad()
            loss_of(model, *batch(0, t)).backward()
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert wrapped.stats.extra_state_bytes == 0  # nothing to average with: no copy kept


def test_diloco_in_one_process_takes_outer_steps_like_the_simulation():
    model = make_model()
    opt = DistributedOptimizer(INNER["adam"](model.parameters()), sync_every=3, outer_optimizer=OUTER["nesterov"])
    trace, _, _ = simulate([10], 3, "adam", "nesterov")
    for t in range(10):
        opt.zero_grad()
        loss_of(model, *batch(0, t)).backward()
        opt.step()
        assert max_diff(params_of(model), trace[0][t]) < TOL
    assert opt.state_dict()[STATE_KEY]["since_sync"] == 1


OUTER_SGD = OUTER["nesterov"]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sync_every": 0}, ValueError, r"sync_every must be an int >= 1 .*got 0"),
    ({"sync_every": 2.5}, TypeError, r"sync_every must be an int, got 2.5; pass e.g. sync_every="),
    ({"sync_every": True}, TypeError, r"sync_every must be an int, got True"),
    ({"local_warmup": -1, "sync_every": 2}, ValueError, r"local_warmup must be an int >= 0 .*got -1"),
    ({"local_warmup": 3}, ValueError, r"local_warmup=3 needs local SGD: pass sync_every > 1"),
    ({"outer_optimizer": "sgd"}, TypeError, r"outer_optimizer must be a function .*got str; pass e.g. outer_"),
    ({"sync_every": 4, "reduce_op": "sum"}, ValueError, r"reduce_op='sum' cannot be combined .*use reduce_op='mean'"),
    ({"sync_every": 4, "bcast_period": 10}, ValueError, r"bcast_period=10 cannot be combined .*use bcast_period=0"),
])
def test_bad_local_sgd_arguments_name_the_argument_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(INNER["sgd"](make_model().parameters()), **kwargs)


def test_an_optimizer_instead_of_a_factory_or_one_over_the_model_is_refused_with_the_fix():
    model = make_model()
    with pytest.raises(TypeError, match=r"got SGD; pass e.g. outer_optimizer=lambda ps"):
        DistributedOptimizer(INNER["sgd"](model.parameters()), outer_optimizer=torch.optim.SGD(model.parameters()))
    with pytest.raises(ValueError, match=r"over the tensors it is given .*not over the model's parameters"):
        DistributedOptimizer(INNER["sgd"](model.parameters()),
                             outer_optimizer=lambda ps: torch.optim.SGD(model.parameters(), lr=0.7))
    with pytest.raises(TypeError, match=r"must return a torch.optim.Optimizer, got list"):
        DistributedOptimizer(INNER["sgd"](model.parameters()), outer_optimizer=lambda ps: list(ps))


def test_the_arguments_reach_distopt_optim_constructors():
    model = make_model()
    opt = distopt.optim.Adam(model.parameters(), lr=0.01, sync_every=8, outer_optimizer=OUTER_SGD, local_warmup=2)
    assert (opt._mode.sync_every, opt._mode.local_warmup) == (8, 2)
    assert opt._settings()["sync_every"] == 8 and opt._settings()["outer_optimizer"] is True


def test_a_state_dict_saved_with_an_outer_optimizer_needs_one_to_load():
    model = make_model()
    saved = DistributedOptimizer(INNER["sgd"](model.parameters()), outer_optimizer=OUTER_SGD).state_dict()
    other = DistributedOptimizer(INNER["sgd"](model.parameters()), sync_every=2)
    with pytest.raises(ValueError, match="pass the same outer_optimizer="):
        other.load_state_dict(saved)
    plain = DistributedOptimizer(INNER["sgd"](model.parameters()))
    plain.load_state_dict(saved)  # synchronous: the inner part loads, the extra key is ignored


def grown_diloco(model, history, at_construction):
    """DiLoCo over ``model`` whose last layer joins late (``history``: "add_param_group" or "unfrozen"),
    or is there from the start (``at_construction``, as a wrapper rebuilt from a checkpoint would be)."""
    first = list(model[0].parameters()) + list(model[2].parameters())
    last = list(model[4].parameters())
    if history == "add_param_group" and not at_construction:
        inner = INNER["momentum"](first)
    else:
        inner = INNER["momentum"]([{"params": first}, {"params": last}])
        for p in last:
            p.requires_grad_(at_construction or history != "unfrozen")
    return DistributedOptimizer(inner, sync_every=3, outer_optimizer=OUTER["nesterov"])


def grow(model, opt, history):
    if history == "add_param_group":
        opt.add_param_group({"params": list(model[4].parameters())})
    else:
        model[4].requires_grad_(True)


def run_local(model, opt, start, stop):
    for t in range(start, stop):
        opt.zero_grad()
        loss_of(model, *batch(0, t)).backward()
        opt.step()


@pytest.mark.parametrize("rebuilt", ["with the final groups", "replaying the history"])
@pytest.mark.parametrize("history", ["add_param_group", "unfrozen"])
def test_a_diloco_checkpoint_after_new_outer_groups_resumes_bitwise_however_the_wrapper_is_rebuilt(history, rebuilt):
    model = make_model()
    opt = grown_diloco(model, history, at_construction=False)
    run_local(model, opt, 0, 4)
    grow(model, opt, history)
    run_local(model, opt, 4, 8)  # mid-period: since_sync is 2
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert len(saved["opt"][STATE_KEY]["outer_groups"]) == 2
    run_local(model, opt, 8, 12)
    straight = params_of(model)
    opt.close()
    model = make_model(seed=1)
    opt = grown_diloco(model, history, at_construction=rebuilt == "with the final groups")
    if rebuilt == "replaying the history":
        grow(model, opt, history)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert opt._mode.outer_layout(opt._context) == saved["opt"][STATE_KEY]["outer_groups"]
    run_local(model, opt, 8, 12)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), straight))


def test_a_local_sgd_load_that_fails_leaves_the_wrapper_as_it_was():
    model = make_model()
    opt = grown_diloco(model, "add_param_group", at_construction=True)
    run_local(model, opt, 0, 4)
    saved = opt.state_dict()
    other = make_model(seed=1)
    fresh = grown_diloco(other, "add_param_group", at_construction=True)
    run_local(other, fresh, 0, 3)  # a sync: the outer optimizer has state
    before = state_of(fresh)
    before = dict(before, anchors=[a.clone() for a in before["anchors"]], outer=[v.clone() for v in before["outer"]])
    extra_group = dict(saved, param_groups=saved["param_groups"] + [dict(saved["param_groups"][0], params=[])])
    bad_layout = dict(saved, **{STATE_KEY: dict(saved[STATE_KEY], outer_groups=[[0, 0, 1, 2, 3, 4]])})
    with pytest.raises(ValueError, match="different number of parameter groups"):  # the inner optimizer's
        fresh.load_state_dict(extra_group)
    with pytest.raises(ValueError, match=r"'outer_groups'\] = \[\[0, 0, 1, 2, 3, 4\]\] does not fit"):
        fresh.load_state_dict(bad_layout)
    after = state_of(fresh)
    assert (after["steps"], after["since_sync"], after["layout"]) == (3, 0, before["layout"])
    assert len(after["outer"]) == len(before["outer"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(after["anchors"] + after["outer"], before["anchors"] + before["outer"]))
    fresh.load_state_dict(saved)
    assert (fresh._engine.steps, fresh._mode.since_sync) == (4, 1)


def test_an_older_diloco_checkpoint_without_the_layout_loads_where_it_did_and_says_why_where_it_cannot():
    model = make_model()
    opt = grown_diloco(model, "add_param_group", at_construction=True)
    run_local(model, opt, 0, 4)
    old = opt.state_dict()
    del old[STATE_KEY]["outer_groups"]
    same = grown_diloco(make_model(), "add_param_group", at_construction=True)
    same.load_state_dict(old)  # one outer group, as when it was saved
    assert all(torch.equal(a, b) for a, b in zip(state_of(same)["outer"], state_of(opt)["outer"]))
    model = make_model()
    grown = grown_diloco(model, "add_param_group", at_construction=False)
    run_local(model, grown, 0, 2)
    grow(model, grown, "add_param_group")
    run_local(model, grown, 2, 4)
    older = grown.state_dict()
    del older[STATE_KEY]["outer_groups"]
    rebuilt = grown_diloco(make_model(), "add_param_group", at_construction=True)
    with pytest.raises(ValueError, match=r"saved by an older distopt.* has 2 param groups of \[4, 2\] tensors, "
                                         r"and this wrapper's would have 1 of \[6\]; build the wrapper as the run"):
        rebuilt.load_state_dict(older)
    assert rebuilt._engine.steps == 0


def test_only_local_sgd_takes_gradscalers_steps_itself():
    model = make_model()
    assert DistributedOptimizer(INNER["sgd"](model.parameters()))._step_supports_amp_scaling is False
    assert DistributedOptimizer(INNER["sgd"](model.parameters()), sync_every=2)._step_supports_amp_scaling is True
