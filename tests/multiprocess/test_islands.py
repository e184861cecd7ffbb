"""Islands: synchronous inside each island, a mode across them (``mode=distopt.Islands(...)``).

One world of 4 ranks, 2 islands x 2 ranks (``[[0, 1], [2, 3]]``, gloo). Every check trains in
float64 and is compared, in the test, against a single-process reference: training on the global
batch (synchronous across), or a replay of the protocol (each island steps on its mean gradient,
the islands sync every H steps). Streaming DiLoCo across is compared with flat streaming DiLoCo
over 2 ranks, each training on its island's whole batch, which is the same protocol.
"""
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import DistributedOptimizer

from _worlds import Worlds

TOL = 1e-12
ISLANDS = [[0, 1], [2, 3]]
ROWS = 4
STEPS = 5


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def island_batch(island, step):
    xs, ys = zip(*(batch(r, step) for r in ISLANDS[island]))
    return torch.cat(xs), torch.cat(ys)


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


INNER = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
OUTER = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731


def train(opt, model, steps, start=0):
    rank = dist.get_rank()
    for t in range(start, start + steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


# ---------------------------------------------------------------------- checks (on every rank)


class WithHeads(nn.Module):
    """A body every rank uses, a head only island 0 uses, and a head no rank uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = make_model()
        self.island0 = nn.Linear(4, 1).double()
        self.unused = nn.Linear(2, 2).double()

    def loss(self, x, y, rank):
        loss = loss_of(self.body, x, y)
        if rank in ISLANDS[0]:
            loss = loss + self.island0(x).pow(2).mean()
        return loss


def synchronous_across():
    rank = dist.get_rank()
    net = WithHeads()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               mode=distopt.Islands(islands=ISLANDS))
    grads_after_backward = []
    for t in range(STEPS):
        x, y = batch(rank, t)
        opt.zero_grad()
        net.loss(x, y, rank).backward()
        grads_after_backward.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
        opt.step()
    return params_of(net), grads_after_backward, opt.mode.topology.islands


def accumulated_and_clipped():
    """Two micro-batches per step (``no_sync()`` on the first), then clipping, which reads the global mean."""
    rank = dist.get_rank()
    net = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), mode=distopt.Islands(islands=ISLANDS))
    norms = []
    for t in range(3):
        opt.zero_grad()
        with opt.no_sync():
            loss_of(net, *batch(rank, 2 * t)).backward()
        loss_of(net, *batch(rank, 2 * t + 1)).backward()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), 0.05)))
        opt.step()
    return params_of(net), norms


def with_grad_scaler():
    """``GradScaler``: an inf on one rank of island 1 at step 1 reaches every rank of every island through the
    cross-island sum, so every rank skips that step and lowers its scale alike."""
    rank = dist.get_rank()
    net = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands(islands=ISLANDS))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for t in range(3):
        opt.zero_grad()
        loss = loss_of(net, *batch(rank, t))
        if t == 1 and rank == 3:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return params_of(net), scaler.get_scale()


def added_group(reference=False):
    """``add_param_group()`` after 2 steps: the new parameters are summed across in slices of their own."""
    net = WithHeads()
    rank = dist.get_rank() if not reference else None
    opt = torch.optim.SGD(net.body.parameters(), lr=0.1, momentum=0.9)
    if not reference:
        opt = DistributedOptimizer(opt, mode=distopt.Islands(islands=ISLANDS))
    for t in range(4):
        if t == 2:
            opt.add_param_group({"params": list(net.island0.parameters()), "lr": 0.05})
        opt.zero_grad()
        if reference:
            sum(net.loss(*batch(r, t), r) for r in range(4)).div(4).backward()
        else:
            net.loss(*batch(rank, t), rank).backward()
        opt.step()
    return params_of(net)


def compressed_across():
    net = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               mode=distopt.Islands(islands=ISLANDS, compression="int8"))
    train(opt, net, STEPS)
    return params_of(net), opt.mode.across_stats.bytes


def local_across(outer):
    """STEPS steps (the last one local), then ``sync_now()``."""
    net = make_model()
    mode = distopt.DiLoCo(2, OUTER) if outer else distopt.LocalSGD(2)
    opt = DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(across=mode, islands=ISLANDS))
    train(opt, net, STEPS)
    local = params_of(net)
    opt.sync_now()
    return local, params_of(net)


def islands_of_one_rank():
    """Islands of one rank each, DiLoCo across: flat DiLoCo over the 4 ranks; and over a subgroup of the
    world (ranks 0, 1 and ranks 2, 3: islands built by their members alone), flat DiLoCo over the subgroup."""
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    half, members = halves[rank // 2], [[0], [1]] if rank < 2 else [[2], [3]]
    runs = []
    for mode, group in ((distopt.Islands(across=distopt.DiLoCo(2, OUTER), islands=[[0], [1], [2], [3]]), None),
                        (distopt.DiLoCo(2, OUTER), None),
                        (distopt.Islands(across=distopt.DiLoCo(2, OUTER), islands=members), half),
                        (distopt.DiLoCo(2, OUTER), half)):
        net = make_model()
        opt = DistributedOptimizer(INNER(net.parameters()), mode=mode, process_group=group)
        train(opt, net, 4)
        runs.append(params_of(net))
    return runs


def local_across_with_grad_scaler():
    """DiLoCo across and GradScaler: an inf on rank 3 at step 1 skips island 1's inner step (its ranks hold
    the island's mean gradient) but not island 0's; the step counts, and the islands' syncs stay paired."""
    rank = dist.get_rank()
    net = make_model()
    opt = DistributedOptimizer(INNER(net.parameters()),
                               mode=distopt.Islands(across=distopt.DiLoCo(2, OUTER), islands=ISLANDS))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for t in range(STEPS):
        opt.zero_grad()
        loss = loss_of(net, *batch(rank, t))
        if t == 1 and rank == 3:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return params_of(net)


def streaming_across():
    """Islands over streaming DiLoCo, and flat streaming DiLoCo over the across groups with island batches."""
    rank = dist.get_rank()
    mode = lambda: distopt.DiLoCo(4, OUTER, fragments=2, overlap=1)  # noqa: E731
    net = make_model()
    opt = DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(across=mode(), islands=ISLANDS))
    train(opt, net, 8)
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    flat = make_model()
    flat_opt = DistributedOptimizer(INNER(flat.parameters()), mode=mode(), process_group=across)
    island = 0 if rank in ISLANDS[0] else 1
    for t in range(8):
        x, y = island_batch(island, t)
        flat_opt.zero_grad()
        loss_of(flat, x, y).backward()
        flat_opt.step()
    return params_of(net), params_of(flat)


def resume():
    """DiLoCo across with int8 across: save between two syncs, resume in a new wrapper, bitwise."""
    def build():
        net = make_model()
        mode = distopt.Islands(across=distopt.DiLoCo(3, OUTER), islands=ISLANDS, compression="int8")
        return net, DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01), mode=mode)

    net, opt = build()
    train(opt, net, 4)
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
    train(opt, net, 4, start=4)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    again, again_opt = build()
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    train(again_opt, again, 4, start=4)
    return params_of(net), params_of(again), sorted(saved["opt"])


def bytes_across():
    """Cross-island bytes per rank vs flat's, on 8 layers of 32 x 32: every rank carries its half of the
    gradients, plus one pack's presence and control flags (11 values), which flat's 16 presence flags outweigh."""
    def layers():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])

    net, flat_net = layers(), layers()
    islands = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands(islands=ISLANDS))
    flat = DistributedOptimizer(torch.optim.SGD(flat_net.parameters(), lr=0.1))
    x = torch.randn(4, 32)
    for model, opt in ((net, islands), (flat_net, flat)):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    held = islands.stats.extra_state_bytes  # the slices' buffers: this rank's slot and the gathered layout
    return islands.mode.across_stats.bytes, flat.stats.bytes, sum(p.numel() * 4 for p in net.parameters()), held


def mismatched(kind):
    """Ranks that disagree on the islands: every rank raises the same error, before any group is built."""
    rank = dist.get_rank()
    islands = {"differ": ISLANDS if rank == 0 else [[0, 2], [1, 3]],
               "overlap": ISLANDS if rank != 2 else [[0, 1], [1, 3]], "model": ISLANDS}[kind]
    net = make_model() if kind != "model" or rank < 2 else nn.Sequential(nn.Linear(4, 9)).double()
    try:
        DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands(islands=islands))
    except ValueError as exc:
        return str(exc)
    return None


def mesh_and_hosts():
    """Islands from a DeviceMesh ("replicate", "shard"), and by default one island per host (the spawn
    helper starts the 4 ranks on one host)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands(islands=mesh))
    train(opt, net, 2)
    hosts = DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), mode=distopt.Islands())
    # As torchrun sets it up on 2 hosts of 2 processes each, every host's ranks numbered in turn.
    rank, saved = dist.get_rank(), dict(os.environ)
    os.environ.update(GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2")
    try:
        torchrun = DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), mode=distopt.Islands())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return (opt.mode.topology.islands, params_of(net), hosts.mode.topology.islands, hosts.world_size,
            torchrun.mode.topology.islands)


def starts_identical_and_refuses_join():
    """Each rank builds its own initial parameters; the wrapper gives every rank island 0's root's. With DiLoCo
    across, a step inside join() is refused on every rank, before any collective."""
    rank = dist.get_rank()
    net = make_model(seed=rank)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                               mode=distopt.Islands(across=distopt.DiLoCo(2, OUTER), islands=ISLANDS))
    start = params_of(net)
    try:
        with opt.join():
            train(opt, net, 1)
    except RuntimeError as exc:
        return start, str(exc)
    return start, None


def joined_with_another():
    """An Islands wrapper and a plain one in one join block: refused on every rank as the block opens (a rank
    that runs out follows the islands' rounds alone, so the plain wrapper's rounds would wait for it)."""
    rank = dist.get_rank()
    net, other = make_model(), make_model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands(islands=ISLANDS))
    plain = DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1))
    try:
        with distopt.join(opt, plain):
            train(opt, net, 1 + rank)
    except RuntimeError as exc:
        return str(exc)
    return None


BATCHES = {0: 4, 1: 2, 2: 5, 3: 5}  # island 0 runs out (both ranks) while island 1 trains on


def uneven_batches(divide_by_world=False):
    """join() with synchronous training across: each rank runs out of data at its own step."""
    rank = dist.get_rank()
    net = make_model()
    # A drift check is due every 2 steps: at step 4, island 1 trains whole, and must not run it without island 0.
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               mode=distopt.Islands(islands=ISLANDS), check_every=2)
    with opt.join(divide_by_world=divide_by_world):
        train(opt, net, BATCHES[rank])
    report = opt.check_drift()  # every rank of every island holds the same state and step count again
    train(opt, net, 1, start=10)  # and trains on together
    return params_of(net), report.step, report.drifted


def drift_across(across):
    """The whole of island 1 moves a parameter: the ranks of each island still agree, the islands do not."""
    rank = dist.get_rank()
    net = make_model()
    mode = distopt.Islands(across=distopt.DiLoCo(2, OUTER) if across else None, islands=ISLANDS)
    opt = DistributedOptimizer(INNER(net.parameters()), mode=mode, named_parameters=net.named_parameters())
    train(opt, net, 3)  # with DiLoCo across, step 3 is local: the islands' parameters differ on purpose
    clean = opt.check_drift()
    if rank in ISLANDS[1]:
        with torch.no_grad():
            if across:  # the last-sync copies (the state dict holds them, not copies) are what DiLoCo keeps alike
                opt.state_dict()["distopt_local_sgd"]["anchors"][1].add_(1e-3)
            else:
                net[0].bias.add_(1e-3)
    try:
        opt.check_drift()
    except distopt.DriftError as exc:
        return clean.drifted, str(exc)
    return clean.drifted, None


def rebroadcast_across():
    """``bcast_period=2``: island 1 moves a parameter after step 1; the re-broadcast after step 2 gives every
    rank of every island island 0's root's parameters."""
    rank = dist.get_rank()
    net = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands(islands=ISLANDS),
                               bcast_period=2, check_every=0)
    train(opt, net, 1)
    if rank in ISLANDS[1]:
        with torch.no_grad():
            net[0].bias.add_(1e-3)
    train(opt, net, 1, start=1)
    return params_of(net)


def root_loads_and_broadcasts():
    """DiLoCo across: a checkpoint right after a sync, loaded on rank 0 only and broadcast to every island
    (parameters, optimizer state, the across mode's), trains on as the uninterrupted run, bitwise."""
    rank = dist.get_rank()

    def build():
        net = make_model()
        mode = distopt.Islands(across=distopt.DiLoCo(2, OUTER), islands=ISLANDS)
        return net, DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=mode)

    net, opt = build()
    train(opt, net, 4)  # step 4 syncs: every rank holds the same parameters and state
    saved = {"model": {k: v.clone() for k, v in net.state_dict().items()}, "opt": copy_of(opt.state_dict())}
    train(opt, net, 3, start=4)
    again, again_opt = build()
    if rank == 0:
        again.load_state_dict(saved["model"])
        again_opt.load_state_dict(saved["opt"])
    again_opt.broadcast_parameters()
    again_opt.broadcast_optimizer_state()
    train(again_opt, again, 3, start=4)
    return params_of(net), params_of(again)


def copy_of(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def subgroup_after_a_closed_wrapper():
    """torch names a group built by its members alone after its ranks and the number of groups a process
    holds, which falls when a wrapper over the default group is closed: the next wrapper over a subgroup
    must still get a group of its own (the islands' groups and channels are such groups)."""
    subgroup = dist.new_group([0, 1, 2, 3])
    flat = DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1))
    first = DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), process_group=subgroup)
    flat.close()
    second_net = make_model()
    second = DistributedOptimizer(torch.optim.SGD(second_net.parameters(), lr=0.1), process_group=subgroup)
    train(second, second_net, 1)
    return first.world_size, second.world_size, params_of(second_net)




# ---------------------------------------------------------------------- FSDP2 inside the islands


def fsdp_model(mesh, seed=0):
    """make_model(), sharded by FSDP2 over the island's dimension of ``mesh``."""
    from torch.distributed.fsdp import fully_shard
    net = make_model(seed)
    fully_shard(net, mesh=mesh)
    return net


def island_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def full_params_of(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def fsdp_train(opt, model, steps, start=0, grads=None):
    rank = dist.get_rank()
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
        if grads is not None:  # the gradients the step took: the global mean, gathered
            grads.append([p.grad.full_tensor().clone() for p in model.parameters()])


def fsdp_synchronous():
    """FSDP2 inside, synchronous across: the full parameters and the gradients each step took."""
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               mode=distopt.Islands(islands=mesh))
    grads = []
    fsdp_train(opt, net, STEPS, grads=grads)
    return full_params_of(net), grads, opt.world_size


def fsdp_local(streaming):
    """FSDP2 inside, DiLoCo (or streaming DiLoCo) across; and, for streaming, flat streaming DiLoCo over the
    across groups on a plain model with the islands' batches (the same protocol)."""
    rank = dist.get_rank()
    mode = (lambda: distopt.DiLoCo(4, OUTER, fragments=2, overlap=1)) if streaming else (  # noqa: E731
        lambda: distopt.DiLoCo(2, OUTER))
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    opt = DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(across=mode(), islands=mesh))
    steps = 8 if streaming else STEPS
    fsdp_train(opt, net, steps)
    local = full_params_of(net)
    if not streaming:
        opt.sync_now()
        return local, full_params_of(net)
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    flat = make_model()
    flat_opt = DistributedOptimizer(INNER(flat.parameters()), mode=mode(), process_group=across)
    island = 0 if rank in ISLANDS[0] else 1
    for t in range(steps):
        flat_opt.zero_grad()
        loss_of(flat, *island_batch(island, t)).backward()
        flat_opt.step()
    return local, params_of(flat)


def fsdp_checkpoint():
    """FSDP2 inside, synchronous across, AdamW: saved with torch.distributed.checkpoint after 2 steps, loaded
    into a new model and wrapper, trained 2 more steps; against the uninterrupted run."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    mesh = island_mesh()
    directory = [tempfile.mkdtemp(prefix="distopt-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    directory = directory[0]

    def build(seed):
        net = fsdp_model(mesh["shard"], seed)
        return net, DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.01),
                                         mode=distopt.Islands(islands=mesh))

    net, opt = build(0)
    fsdp_train(opt, net, 2)
    dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)},
             checkpoint_id=directory)
    fsdp_train(opt, net, 2, start=2)
    resumed_net, resumed = build(1)  # other weights: all of them must come from the checkpoint
    state = {"model": get_model_state_dict(resumed_net), "optim": get_optimizer_state_dict(resumed_net, resumed)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(resumed_net, state["model"])
    set_optimizer_state_dict(resumed_net, resumed, state["optim"])
    fsdp_train(resumed, resumed_net, 2, start=2)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    return full_params_of(net), full_params_of(resumed_net)


def fsdp_resume():
    """FSDP2 inside, DiLoCo across with int8 across and Adam inside: each rank saves its own state between two
    syncs (its shards), and a new model and wrapper resume from it; against the uninterrupted run."""
    mesh = island_mesh()

    def build(seed):
        net = fsdp_model(mesh["shard"], seed)
        mode = distopt.Islands(across=distopt.DiLoCo(3, OUTER), islands=mesh, compression="int8")
        return net, DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01), mode=mode)

    net, opt = build(0)
    fsdp_train(opt, net, 4)
    saved = copy_of({"model": net.state_dict(), "opt": opt.state_dict()})
    fsdp_train(opt, net, 4, start=4)
    again, again_opt = build(1)
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    fsdp_train(again_opt, again, 4, start=4)
    return full_params_of(net), full_params_of(again)


class HeadsInForward(nn.Module):
    """WithHeads, with the heads in ``forward`` (FSDP2 gathers its parameters there): island 0 uses a head
    that island 1 does not, and no rank uses the last one."""

    def __init__(self):
        super().__init__()
        heads = WithHeads()
        self.body, self.island0, self.unused = heads.body, heads.island0, heads.unused

    def forward(self, x, y, island0):
        loss = loss_of(self.body, x, y)
        return loss + self.island0(x).pow(2).mean() if island0 else loss


def fsdp_unused_heads():
    """FSDP2 inside, synchronous across: a head only island 0 uses (island 1 has no gradient for it)."""
    from torch.distributed.fsdp import fully_shard
    rank = dist.get_rank()
    mesh = island_mesh()
    net = HeadsInForward()
    fully_shard(net, mesh=mesh["shard"])
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               mode=distopt.Islands(islands=mesh))
    for t in range(STEPS):
        opt.zero_grad()
        net(*batch(rank, t), rank in ISLANDS[0]).backward()
        opt.step()
    return full_params_of(net), [p.grad is None for p in net.parameters()]


def fsdp_clipped():
    """FSDP2 inside, synchronous across: opt.synchronize() then clipping, which reads the global mean."""
    rank = dist.get_rank()
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), mode=distopt.Islands(islands=mesh))
    norms = []
    for t in range(3):
        opt.zero_grad()
        loss_of(net, *batch(rank, t)).backward()
        opt.synchronize()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), 0.05).full_tensor()))
        opt.step()
    return full_params_of(net), norms


def fsdp_compressed():
    """FSDP2 inside, synchronous across in int8: the local shards, and the full parameters."""
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               mode=distopt.Islands(islands=mesh, compression="int8"))
    fsdp_train(opt, net, STEPS)
    return [p.to_local().detach().clone() for p in net.parameters()], full_params_of(net)


def fsdp_drift(across):
    """FSDP2 inside: rank 3 moves its shard of a parameter (with DiLoCo across: of its last-sync copy)."""
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    mode = distopt.Islands(across=distopt.DiLoCo(2, OUTER) if across else None, islands=mesh)
    opt = DistributedOptimizer(INNER(net.parameters()), mode=mode, named_parameters=net.named_parameters())
    fsdp_train(opt, net, 3)
    clean = opt.check_drift()
    if dist.get_rank() == 3:
        with torch.no_grad():
            if across:
                opt.state_dict()["distopt_local_sgd"]["anchors"][1].add_(1e-3)
            else:
                net[0].bias.to_local().add_(1e-3)
    try:
        opt.check_drift()
    except distopt.DriftError as exc:
        return clean.drifted, str(exc)
    return clean.drifted, None


def fsdp_rebroadcast():
    """FSDP2 inside, bcast_period=2: rank 3 moves its shard after step 1; the local shards after step 2."""
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    opt = DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(islands=mesh), bcast_period=2)
    fsdp_train(opt, net, 1)
    if dist.get_rank() == 3:
        with torch.no_grad():
            net[0].bias.to_local().add_(1e-3)
    fsdp_train(opt, net, 1, start=1)
    return [p.to_local().detach().clone() for p in net.parameters()]


def fsdp_join():
    """FSDP2 inside: a step inside join() is refused on every rank."""
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    opt = DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(islands=mesh))
    try:
        with opt.join():
            fsdp_train(opt, net, 1)
    except RuntimeError as exc:
        return str(exc)
    return None


def fsdp_added_group():
    """FSDP2 inside: a param group added after construction is refused at the next step, on every rank."""
    mesh = island_mesh()
    net = fsdp_model(mesh["shard"])
    params = list(net.parameters())
    opt = DistributedOptimizer(INNER(params[:2]), mode=distopt.Islands(islands=mesh))
    opt.add_param_group({"params": params[2:]})
    try:
        fsdp_train(opt, net, 1)
    except RuntimeError as exc:
        return str(exc)
    return None


def drift_islands_of_one():
    """Islands of one rank, DiLoCo across: the drift check compares the islands (the wrapper's world is one)."""
    net = make_model()
    opt = DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(
        across=distopt.DiLoCo(2, OUTER), islands=[[0], [1], [2], [3]]))
    train(opt, net, 2)
    clean = opt.check_drift()
    if dist.get_rank() == 3:
        with torch.no_grad():
            net[0].bias.add_(1e-3)
    try:
        opt.check_drift()
    except distopt.DriftError as exc:
        return clean.compared, str(exc)
    return clean.compared, None


def fsdp_mismatched(kind):
    """FSDP2 over the wrong ranks (the whole world, with islands of 2; HSDP's 2-D mesh), or a replicated DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = island_mesh()
    if kind == "replicate":  # a DTensor that nothing averages inside the island
        from torch.distributed.tensor import Replicate, distribute_tensor
        net = make_model()
        net[0].weight = nn.Parameter(distribute_tensor(net[0].weight.detach(), mesh["shard"], [Replicate()]))
    else:
        net = fsdp_model(init_device_mesh("cpu", (4,)) if kind == "world" else mesh)
    try:
        DistributedOptimizer(INNER(net.parameters()), mode=distopt.Islands(islands=mesh))
    except ValueError as exc:
        return str(exc)
    return None


CASES = {
    "synchronous": (4, synchronous_across, ()),
    "accumulated": (4, accumulated_and_clipped, ()),
    "compressed": (4, compressed_across, ()),
    "added group": (4, added_group, ()),
    "grad scaler": (4, with_grad_scaler, ()),
    "local sgd": (4, local_across, (False,)),
    "diloco": (4, local_across, (True,)),
    "streaming": (4, streaming_across, ()),
    "resume": (4, resume, ()),
    "bytes": (4, bytes_across, ()),
    "differ": (4, mismatched, ("differ",)),
    "overlap": (4, mismatched, ("overlap",)),
    "model": (4, mismatched, ("model",)),
    "islands of one": (4, islands_of_one_rank, ()),
    "local grad scaler": (4, local_across_with_grad_scaler, ()),
    "mesh": (4, mesh_and_hosts, ()),
    "start": (4, starts_identical_and_refuses_join, ()),
    "join": (4, uneven_batches, ()),
    "join with another": (4, joined_with_another, ()),
    "join divide_by_world": (4, uneven_batches, (True,)),
    "closed wrapper": (4, subgroup_after_a_closed_wrapper, ()),
    "drift": (4, drift_across, (False,)),
    "rebroadcast": (4, rebroadcast_across, ()),
    "root loads": (4, root_loads_and_broadcasts, ()),
    "drift diloco": (4, drift_across, (True,)),
    "fsdp synchronous": (4, fsdp_synchronous, ()),
    "fsdp diloco": (4, fsdp_local, (False,)),
    "fsdp streaming": (4, fsdp_local, (True,)),
    "fsdp checkpoint": (4, fsdp_checkpoint, ()),
    "fsdp world mesh": (4, fsdp_mismatched, ("world",)),
    "fsdp hsdp": (4, fsdp_mismatched, ("hsdp",)),
    "fsdp replicate": (4, fsdp_mismatched, ("replicate",)),
    "fsdp compressed": (4, fsdp_compressed, ()),
    "fsdp resume": (4, fsdp_resume, ()),
    "fsdp added group": (4, fsdp_added_group, ()),
    "fsdp join": (4, fsdp_join, ()),
    "fsdp rebroadcast": (4, fsdp_rebroadcast, ()),
    "fsdp unused heads": (4, fsdp_unused_heads, ()),
    "fsdp clipped": (4, fsdp_clipped, ()),
    "drift islands of one": (4, drift_islands_of_one, ()),
    "fsdp drift": (4, fsdp_drift, (False,)),
    "fsdp drift diloco": (4, fsdp_drift, (True,)),
}
WORLDS = Worlds(CASES, timeout=200)
results = WORLDS.results


# ---------------------------------------------------------------------- references (one process)


def global_batch_reference():
    net = WithHeads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for t in range(STEPS):
        opt.zero_grad()
        # Each rank's mean loss, averaged over the ranks: the global batch's mean, the heads as each rank uses them.
        sum(net.loss(*batch(r, t), r) for r in range(4)).div(4).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
        opt.step()
    return params_of(net), grads


def accumulated_reference():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    norms = []
    for t in range(3):
        opt.zero_grad()
        for micro in (2 * t, 2 * t + 1):  # summed over the micro-batches, averaged over the ranks
            sum(loss_of(net, *batch(r, micro)) for r in range(4)).div(4).backward()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), 0.05)))
        opt.step()
    return params_of(net), norms


def local_reference(outer, steps=STEPS, every=2, sync_at_end=False, skipped=()):
    """The protocol replayed: each island steps its own copy on its mean gradient (the gradient of its
    whole batch's mean loss), and every ``every`` steps the islands average (or step the outer optimizer on)
    the mean pseudo-gradient. ``skipped``: (island, step) whose inner step is skipped."""
    models = [make_model(), make_model()]
    inners = [INNER(m.parameters()) for m in models]
    anchors = params_of(models[0])
    outer_opt = OUTER(anchors) if outer else None
    for t in range(steps):
        for i, (m, o) in enumerate(zip(models, inners)):
            o.zero_grad()
            loss_of(m, *island_batch(i, t)).backward()
            if (i, t) not in skipped:
                o.step()
        if (t + 1) % every == 0 or (sync_at_end and t == steps - 1):
            with torch.no_grad():
                pseudo = [((a - p0) + (a - p1)) / 2 for a, p0, p1 in zip(anchors, models[0].parameters(), models[1].parameters())]
                if outer_opt is None:
                    for a, g in zip(anchors, pseudo):
                        a.sub_(g)
                else:
                    for a, g in zip(anchors, pseudo):
                        a.grad = g
                    outer_opt.step()
                for m in models:
                    for p, a in zip(m.parameters(), anchors):
                        p.copy_(a)
    return [params_of(m) for m in models]


def close(a, b, tol=TOL):
    return all((x - y).abs().max().item() <= tol for x, y in zip(a, b))


# ---------------------------------------------------------------------- tests


def test_synchronous_inside_and_across_trains_as_one_process_on_the_global_batch():
    per_rank = results("synchronous")
    params, grads = global_batch_reference()
    assert per_rank[0][2] == ((0, 1), (2, 3))
    for rank_params, rank_grads, _ in per_rank:
        assert close(rank_params, params)
        for step, (got, want) in enumerate(zip(rank_grads, grads)):
            # .grad is the global mean when backward() returns (clipping and GradScaler read it there).
            for g, w in zip(got, want):
                assert (g is None) == (w is None), step
                assert g is None or (g - w).abs().max().item() <= TOL
    # The head no rank uses keeps grad None and does not move; every rank holds the same bits.
    assert per_rank[0][1][-1][-1] is None and per_rank[0][1][-1][-2] is None
    for other in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][0], other[0]))


def test_accumulation_and_clipping_see_the_global_mean_as_synchronous_training_does():
    params, norms = accumulated_reference()
    for rank_params, rank_norms in results("accumulated"):
        assert close(rank_params, params)
        assert max(abs(a - b) for a, b in zip(rank_norms, norms)) <= TOL
        assert min(norms) > 0.05  # the clipping bit


def test_grad_scaler_skips_a_step_with_an_inf_on_one_rank_on_every_rank_of_every_island():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for t in (0, 2):  # step 1 is skipped
        opt.zero_grad()
        sum(loss_of(net, *batch(r, t)) for r in range(4)).div(4).backward()
        opt.step()
    for params, scale in results("grad scaler"):
        assert scale == 2.0 ** 9
        assert close(params, params_of(net))


def test_a_param_group_added_mid_training_is_summed_across_as_one_process_sums_it():
    reference = added_group(reference=True)
    for params in results("added group"):
        assert close(params, reference)


def test_compression_across_leaves_every_rank_of_every_island_bitwise_identical():
    per_rank = results("compressed")
    first = per_rank[0][0]
    for params, _ in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, params))
    reference = local_reference(False, steps=0)[0]  # the initial parameters
    assert not all(torch.equal(a, b) for a, b in zip(first, reference))  # it trained
    assert per_rank[0][1] > 0


@pytest.mark.parametrize("case, outer", [("local sgd", False), ("diloco", True)])
def test_local_sgd_and_diloco_across_match_a_replay_of_the_protocol(case, outer):
    per_rank = results(case)
    replay = local_reference(outer)
    synced = local_reference(outer, sync_at_end=True)[0]
    for rank, (params, after_sync_now) in enumerate(per_rank):
        island = 0 if rank in ISLANDS[0] else 1
        assert close(params, replay[island])
        assert close(after_sync_now, synced)  # sync_now() syncs the islands at once
        # The ranks of an island are identical at every step, and all ranks right after a sync.
        assert all(torch.equal(a, b) for a, b in zip(after_sync_now, per_rank[0][1]))
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0][0], per_rank[1][0]))
    assert not close(per_rank[0][0], per_rank[2][0], tol=0.0)  # step 5 was local: the islands differ


def test_islands_of_one_rank_with_diloco_across_are_flat_diloco():
    for islands, flat, islands_of_subgroup, flat_of_subgroup in results("islands of one"):
        assert close(islands, flat)
        assert close(islands_of_subgroup, flat_of_subgroup)


def test_diloco_across_with_grad_scaler_skips_the_inner_step_of_the_island_that_saw_an_inf():
    replay = local_reference(True, skipped={(1, 1)})
    for rank, params in enumerate(results("local grad scaler")):
        assert close(params, replay[0 if rank in ISLANDS[0] else 1])


def test_streaming_diloco_across_islands_is_flat_streaming_diloco_on_the_islands_batches():
    for rank, (islands, flat) in enumerate(results("streaming")):
        assert close(islands, flat)


def test_a_checkpoint_between_two_syncs_resumes_bitwise_with_the_across_mode_and_compressor_state():
    for uninterrupted, resumed, keys in results("resume"):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
        assert "distopt_local_sgd" in keys and "distopt_islands" in keys


def test_each_rank_carries_at_most_1_over_k_of_flat_bytes_across_the_islands():
    for across, flat, gradient_bytes, held in results("bytes"):
        assert held == gradient_bytes // 2 + gradient_bytes  # a slot of 1/k and the whole, in float32
        assert flat >= gradient_bytes
        assert across <= flat / 2
        assert across >= gradient_bytes / 2  # its slice really travels


def test_ranks_that_disagree_on_the_islands_all_get_the_same_error_naming_both_views_and_the_fix():
    messages = results("differ")
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "rank 0 has islands=[[0, 1], [2, 3]] and rank 1 has islands=[[0, 2], [1, 3]]" in messages[0]
    assert "pass the same islands= on every rank" in messages[0]
    overlap = results("overlap")
    assert len(set(overlap)) == 1
    assert overlap[0].startswith("rank 2: islands=[[0, 1], [1, 3]]: rank 1 is in two islands")
    for message in results("model"):  # each island agrees inside; the islands differ
        assert message.startswith(
            "the islands built different optimizers: parameter 0 is of shape [8, 4] torch.float64 on island 0 and "
            "of shape [9, 4] torch.float64 on island 1 (global rank ")


def test_islands_come_from_a_device_mesh_and_by_default_from_the_hosts():
    per_rank = results("mesh")
    for islands, params, hosts, hosts_world, torchrun in per_rank:
        assert islands == ((0, 1), (2, 3))
        assert all(torch.equal(a, b) for a, b in zip(params, per_rank[0][1]))
        assert hosts == ((0, 1, 2, 3),) and hosts_world == 4  # distopt.launch started all 4 on one host
        assert torchrun == ((0, 2), (1, 3))  # GROUP_RANK: ranks 0 and 2 on host 0


def test_every_rank_of_every_island_starts_from_island_0s_parameters():
    reference = params_of(make_model(seed=0))
    for start, _ in results("start"):
        assert all(torch.equal(a, b) for a, b in zip(start, reference))


def test_join_with_local_sgd_across_is_refused_on_every_rank_at_the_first_step_inside_the_block():
    for _, message in results("start"):
        assert message is not None and "join() is not supported yet with distopt.Islands(across=DiLoCo" in message


def test_an_islands_wrapper_joined_in_one_block_with_another_optimizer_is_refused_on_every_rank_as_it_opens():
    for message in results("join with another"):
        assert message is not None and "cannot join in one block with other optimizers" in message, message


@pytest.mark.parametrize("case", ["join", "join divide_by_world"])
def test_uneven_batches_in_join_train_as_one_process_on_the_batches_there_are(case):
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for t in list(range(max(BATCHES.values()))) + [10]:
        ranks = [r for r in range(4) if BATCHES[r] > t or t == 10]
        opt.zero_grad()
        # The mean over the ranks that train (divide_by_world: over all 4, the others counting as zeros).
        sum(loss_of(net, *batch(r, t)) for r in ranks).div(4 if "world" in case else len(ranks)).backward()
        opt.step()
    for params, steps, drifted in results(case):
        assert steps == max(BATCHES.values()) and drifted == []
        assert close(params, params_of(net))


@pytest.mark.parametrize("case", ["drift", "drift diloco"])
def test_the_drift_check_compares_the_islands_with_each_other(case):
    for clean, message in results(case):
        assert clean == []  # trained alike (DiLoCo: the last-sync copies, between two syncs)
        assert message is not None and "'0.bias'" in message, message


def test_bcast_period_re_broadcasts_island_0s_root_to_every_island():
    per_rank = results("rebroadcast")
    for params in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0], params))


def test_a_checkpoint_loaded_on_rank_0_and_broadcast_reaches_every_island_with_the_across_state():
    for uninterrupted, resumed in results("root loads"):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


def test_a_wrapper_over_a_subgroup_gets_its_own_group_after_a_wrapper_over_the_default_group_was_closed():
    per_rank = results("closed wrapper")
    for first, second, params in per_rank:
        assert first == second == 4
        assert all(torch.equal(a, b) for a, b in zip(params, per_rank[0][2]))


def test_fsdp2_inside_and_synchronous_across_trains_as_one_process_on_the_global_batch():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for t in range(STEPS):
        opt.zero_grad()
        sum(loss_of(net, *batch(r, t)) for r in range(4)).div(4).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
    for params, rank_grads, world_size in results("fsdp synchronous"):
        assert close(params, params_of(net))
        # The step took the global mean: FSDP2's mean inside the island, then the shards' mean across.
        assert all(close(got, want) for got, want in zip(rank_grads, grads))
        assert world_size == 1  # FSDP2 owns the island: the wrapper's engine averages nothing there


def test_fsdp2_inside_with_diloco_across_matches_a_replay_of_the_protocol():
    replay = local_reference(True)
    synced = local_reference(True, sync_at_end=True)[0]
    per_rank = results("fsdp diloco")
    for rank, (params, after_sync_now) in enumerate(per_rank):
        assert close(params, replay[0 if rank in ISLANDS[0] else 1])
        assert close(after_sync_now, synced)
    assert not close(per_rank[0][0], per_rank[2][0], tol=0.0)  # step 5 was local: the islands differ


def test_fsdp2_inside_with_streaming_diloco_across_is_flat_streaming_diloco_on_the_islands_batches():
    for islands, flat in results("fsdp streaming"):
        assert close(islands, flat)


@pytest.mark.parametrize("case", ["fsdp checkpoint", "fsdp resume"])
def test_fsdp2_inside_a_checkpoint_resumes_bitwise_through_dcp_or_each_ranks_own_state_dict(case):
    for uninterrupted, resumed in results(case):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


@pytest.mark.parametrize("case, message", [
    ("fsdp world mesh", r"rank 0's parameters are sharded over the ranks \[\[0, 1, 2, 3\]\], but its island is "
                        r"\[0, 1\]: FSDP2 must shard over the island's ranks.*"
                        r"fully_shard\(model, mesh=mesh\['shard'\]\)"),
    ("fsdp hsdp", r"is a DTensor over a 2-D mesh \(placements \(Replicate\(\), Shard\(dim=0\)\)\): FSDP2 over the "
                  r"whole 2-D mesh \(HSDP\) all-reduces.*fully_shard\(model, mesh=mesh\['shard'\]\)"),
    ("fsdp replicate", r"parameter 'param_groups\[0\]\[0\]' is a DTensor with placements \(Replicate\(\),\): "
                       r"distopt.Islands takes FSDP2's sharded parameters"),
])
def test_fsdp2_over_a_mesh_other_than_the_islands_fails_on_every_rank_saying_how_to_shard(case, message):
    import re
    per_rank = results(case)
    assert all(m is not None and re.search(message, m) for m in per_rank), per_rank[0]
    assert len(set(per_rank)) == 1  # one message, every rank


def test_fsdp2_inside_with_compression_across_leaves_the_ranks_of_each_shard_bitwise_identical():
    per_rank = results("fsdp compressed")
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for t in range(STEPS):
        opt.zero_grad()
        sum(loss_of(net, *batch(r, t)) for r in range(4)).div(4).backward()
        opt.step()
    for rank, (shards, full) in enumerate(per_rank):
        same_shard = per_rank[rank % 2][0]  # rank j of island 1 holds island 0's rank j's shards
        assert all(torch.equal(a, b) for a, b in zip(shards, same_shard))
        assert close(full, params_of(net), tol=1e-2) and not close(full, params_of(net))  # int8: near, not equal


@pytest.mark.parametrize("case", ["fsdp drift", "fsdp drift diloco"])
def test_fsdp2_inside_the_drift_check_compares_each_shard_across_the_islands(case):
    errors = []
    for clean, error in results(case):
        assert clean == []
        errors.append(error)
    # Rank 3 moved its shard: its across group finds it, and every rank of both islands raises the same.
    assert errors[0] is not None and "'0.bias' differs between ranks by 0.001" in errors[0]
    assert len(set(errors)) == 1


def test_fsdp2_inside_a_param_group_added_later_is_refused_at_the_next_step_on_every_rank():
    for message in results("fsdp added group"):
        assert message is not None and "add_param_group() with FSDP2 inside the islands is not supported yet" in message


def test_fsdp2_inside_a_step_inside_join_is_refused_on_every_rank():
    for message in results("fsdp join"):
        assert message is not None and "join() with FSDP2 inside the islands is not supported yet" in message


def test_islands_of_one_rank_have_a_drift_check_across_the_islands():
    for compared, error in results("drift islands of one"):
        assert compared > 0
        assert error is not None and "'param_groups[0][1]' differs between ranks by 0.001" in error


def test_fsdp2_inside_bcast_period_re_broadcasts_each_shard_from_island_0():
    per_rank = results("fsdp rebroadcast")
    for rank, shards in enumerate(per_rank):
        assert all(torch.equal(a, b) for a, b in zip(shards, per_rank[rank % 2]))


def test_fsdp2_inside_a_head_one_island_does_not_use_is_averaged_with_its_zeros_and_an_unused_one_keeps_no_grad():
    params, _ = global_batch_reference()  # the same modules, in the same order
    for rank_params, no_grad in results("fsdp unused heads"):
        assert close(rank_params, params)
        assert no_grad == [False] * 6 + [True, True]


def test_fsdp2_inside_synchronize_sums_across_so_that_clipping_sees_the_global_mean():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    norms = []
    for t in range(3):
        opt.zero_grad()
        sum(loss_of(net, *batch(r, t)) for r in range(4)).div(4).backward()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), 0.05)))
        opt.step()
    for params, rank_norms in results("fsdp clipped"):
        assert close(params, params_of(net))
        assert all(abs(a - b) <= TOL for a, b in zip(rank_norms, norms))
