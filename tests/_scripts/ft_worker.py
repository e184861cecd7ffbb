"""One replica of a fault-tolerant job for tests/fault_tolerance and bench/fault_tolerance.py.

Usage: python ft_worker.py '<json spec>'. It hosts its replica group's TCPStore, builds a
torchft Manager (distopt.fault_tolerance.manager.make_manager) and trains a small MLP with
DistributedOptimizer(fault_tolerance=manager) until the committed step count reaches
``steps``. Every step appends one JSON line to ``out``: the step count, whether it committed,
the loss, the world size, and a hash of the parameters and optimizer state. A ``kill`` entry
makes the process SIGKILL itself at a step, inside backward (after its first pack was sent)
or between steps, once ``world`` replicas (default 1) train together: replicas start at
different times on a loaded host, and a kill meant to land in a step of three must not
land in a step that a late starter has not joined yet.

Modes (tests/fault_tolerance/test_fault_tolerance_modes.py): ``stream`` (streaming local SGD:
``{"fragments": F, "overlap": tau, "mixing": alpha}`` beside ``sync_every``; the hash then leaves
the parameters out, which hold each replica's own progress), ``compression`` (a name, or
``"powersgd:R:S"`` for PowerSGD of rank R from step S; the hash then covers PowerSGD's Q,
which must be the same on every replica), ``optimizer`` (``"sgd"``), ``same_init`` (every
replica draws the same initial parameters) and ``start_together`` (wait until that many replicas are up before
the first step) and ``batches`` (the replica has that many
batches: it trains inside ``opt.join()`` while the committed step count is below it, then
shadows the others; after the block it logs ``final`` with the hash and saves its parameters
to ``<out>.pt``). A ``kill`` with ``"where": "shadow"`` SIGKILLs a replica that has joined
after it shadowed ``after`` steps. ``until_file``: the replica trains on past ``steps`` until that
file exists (a test that starts other replicas against it says when it is done). A ``ValueError``
from a step (a replica refused, e.g. built with other settings than the live ones) is logged as
``refused`` before it ends the process, ``linger`` seconds later.
"""
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import distopt
from distopt.fault_tolerance.manager import make_manager

spec = json.loads(sys.argv[1])
out = open(spec["out"], "a", buffering=1)


def log(**fields):
    fields.setdefault("t", time.time())
    out.write(json.dumps(fields) + "\n")


def digest(model, opt):
    """Synchronous: the parameters and Adam's state. Local SGD (right after a sync): the parameters,
    the anchors and the outer optimizer's state (the inner state is each replica's own)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    if compressor is not None and compressor.name == "powersgd":  # Q is the same on every replica
        qs = compressor.state_dict()["qs"]
        for key in sorted(qs):
            h.update(qs[key].detach().numpy().tobytes())
    if stream:  # the parameters are each replica's own: the anchors, the outer optimizer and the steps are not
        h = hashlib.sha256(str(opt._engine.steps).encode())
    if local:
        mine = opt.state_dict()["distopt_local_sgd"]
        if spec.get("outer") and not mine["outer"]:  # hashed right after a sync: DiLoCo has built it by then
            raise RuntimeError("the spec asks for DiLoCo, but the wrapper has no outer optimizer")
        tensors = list(mine["anchors"]) + ([v for st in mine["outer"]["state"].values() for v in st.values()]
                                           if mine["outer"] else [])
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    else:
        tensors = [v for state in opt.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for v in tensors:
        h.update(v.detach().numpy().tobytes())
    return h.hexdigest()[:16]


store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
manager = make_manager(
    replica_id=f"replica_{spec['replica']}", lighthouse=spec["lighthouse"], store_addr="127.0.0.1",
    store_port=store.port, hostname="127.0.0.1", timeout=spec.get("timeout", 3.0), rank=0, world_size=1,
    quorum_timeout=spec.get("quorum_timeout", 30.0),
)
# Different inits (init_sync heals them), or the same one where a test computes the expected parameters.
torch.manual_seed(spec.get("seed", 0) + (0 if spec.get("same_init") else 1000 * spec["replica"]))
width = spec.get("width", 64)
model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh(),
                            torch.nn.Linear(width, 1))
local = spec.get("sync_every", 1) > 1  # local SGD (DiLoCo with "outer"): a quorum and a commit vote per sync
stream = spec.get("stream")
extra = {}
if local:
    extra["sync_every"] = spec["sync_every"]
    if spec.get("outer"):
        extra["outer_optimizer"] = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.5, nesterov=True)
if stream:
    extra.update(sync_fragments=stream["fragments"], sync_overlap=stream["overlap"], sync_mixing=stream.get("mixing", 0.0))
compressor = None
if spec.get("compression"):
    name, *args = spec["compression"].split(":")
    compressor = (distopt.compression.PowerSGD(rank=int(args[0]), start_step=int(args[1])) if name == "powersgd" and args
                  else distopt.compression.resolve(name))
    extra["compression"] = compressor
inner = (torch.optim.SGD(model.parameters(), lr=spec.get("lr", 0.05)) if spec.get("optimizer") == "sgd"
         else torch.optim.Adam(model.parameters(), lr=spec.get("lr", 1e-2)))
opt = distopt.DistributedOptimizer(inner, pack_threshold=spec.get("pack_threshold", 4096), fault_tolerance=manager,
                                   **extra)
log(distopt=distopt.__file__)
kill = spec.get("kill")  # {"step": n, "where": "backward" | "between", "world": m} or {"where": "heal"}


def armed():
    """The kill's step is reached, with at least ``world`` replicas averaged in this (or the last) step."""
    return (manager.current_step() + 1 >= kill["step"]
            and (opt.fault_tolerance.world_size or 0) >= kill.get("world", 1))

if kill and kill["where"] == "heal":  # die inside the heal: the live peer's state has arrived, half loaded
    def heal_then_die(state):
        log(dying="heal", step=manager.current_step())
        os.kill(os.getpid(), signal.SIGKILL)

    opt.optimizer.load_state_dict = heal_then_die
events = []
opt.fault_tolerance.on_world_change = lambda e: (events.append(e), log(event=e.describe(), world=e.world_size,
                                                                          left=list(e.left), joined=list(e.joined),
                                                                          healed=e.healed, step=e.step))
target = torch.randn(16, generator=torch.Generator().manual_seed(7))


def batch(step):
    g = torch.Generator().manual_seed(10_000 * step + spec["replica"])
    x = torch.randn(spec.get("batch", 32), 16, generator=g)
    return x, torch.tanh(x @ target).unsqueeze(1)


if kill and kill["where"] == "backward":
    def die(grad):
        if armed() and opt.stats.packs >= 1:
            if kill.get("signal") == "SIGSTOP":  # silent, not dead: stopped until the harness sends SIGCONT
                if not kill.get("done"):
                    kill["done"] = True
                    log(dying="stopped in backward", step=manager.current_step())
                    os.kill(os.getpid(), signal.SIGSTOP)
                return grad
            log(dying="backward", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
        return grad
    list(model.parameters())[0].register_hook(die)  # the first layer's gradient comes last: packs are in flight

if kill and kill["where"] == "exchange":  # local SGD: die inside a sync's exchange, after its first pack left
    send = opt._engine._send

    def send_then_die(*args, **kwargs):
        send(*args, **kwargs)
        if opt._engine.exchange.fill is not None and armed():
            log(dying="exchange", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)

    opt._engine._send = send_then_die

if kill and kill["where"] == "shadow":  # a replica that has joined dies while it shadows the others
    commit = opt.fault_tolerance.commit

    def commit_then_die(joined=False):
        if joined and opt.fault_tolerance.record.shadowed >= kill.get("after", 1):
            log(dying="shadow", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(joined)

    opt.fault_tolerance.commit = commit_then_die

if spec.get("start_together"):
    # A test whose replicas must all train from the first step (join's uneven inputs: one that trains alone
    # while the others start up uses its batches up alone): wait until that many replicas are ready here.
    mark = spec["out"] + ".ready"
    open(mark, "w").close()
    deadline = time.time() + 60
    while sum(name.endswith(".ready") for name in os.listdir(os.path.dirname(mark))) < spec["start_together"]:
        if time.time() > deadline:
            raise SystemExit(f"only some of the {spec['start_together']} replicas started within 60 s")
        time.sleep(0.01)

pace = spec.get("pace", 0.0)
until_world, streak = spec.get("until_world"), 0
last_committed = last_discarded = 0


def train_step():
    """One step; returns the loss and whether the step committed."""
    before = opt.fault_tolerance.record.committed
    opt.zero_grad()
    x, y = batch(manager.current_step())
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss, opt.fault_tolerance.record.committed > before


if "batches" in spec:  # uneven inputs: this replica's data ends at its own step count
    with opt.join():
        while manager.current_step() < spec["batches"]:
            if kill and kill["where"] == "between" and armed():
                log(dying="between", step=manager.current_step())
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.time()
            loss, ok = train_step()
            ft = opt.stats.fault_tolerance
            log(step=manager.current_step(), committed=ft["committed"], discarded=ft["discarded"], loss=loss.item(),
                world=ft["world_size"], part=opt.fault_tolerance.participating, ok=ok, t0=t0,
                inner=opt._engine.steps, digest=digest(model, opt))
            if pace:
                time.sleep(pace)
    ft = opt.stats.fault_tolerance
    torch.save([p.detach() for p in model.parameters()], spec["out"] + ".pt")
    log(final=digest(model, opt), step=manager.current_step(), inner=opt._engine.steps, shadowed=ft["shadowed"])
    spec["steps"] = 0  # done: the loop below is not entered

started = time.time()
while "batches" not in spec:
    if kill and kill["where"] == "between" and armed():
        log(dying="between", step=manager.current_step())
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.time()
    try:
        loss, ok = train_step()
    except ValueError as error:
        log(refused=str(error), step=manager.current_step(), world=opt.fault_tolerance.world_size)
        time.sleep(spec.get("linger", 0.0))  # as a process that caught it would stay up (its manager too)
        raise
    dt = time.time() - t0
    ft = opt.stats.fault_tolerance
    synced = not local or ft["committed"] != last_committed  # local SGD: hashes compared right after a sync
    last_committed = ft["committed"]
    fields = dict(digest=digest(model, opt)) if synced and spec.get("digest", True) else {}
    if local and ft["discarded"] != last_discarded:  # a sync voted down: its parameters went back to the anchors
        anchors = opt.state_dict()["distopt_local_sgd"]["anchors"]
        fields["at_anchor"] = sum(a is not None and torch.equal(p.detach(), a)
                                  for p, a in zip(model.parameters(), anchors))
    last_discarded = ft["discarded"]
    log(step=manager.current_step(), committed=ft["committed"], discarded=ft["discarded"], loss=loss.item(),
        world=ft["world_size"], t0=t0, dt=dt, inner=opt._engine.steps, part=opt.fault_tolerance.participating, ok=ok,
        last_failure=ft["last_failure"], missing=list(ft["missing"]), **fields)
    if pace:
        time.sleep(pace)
    streak = streak + 1 if ft["world_size"] == until_world else 0
    if (manager.current_step() >= spec["steps"] and (until_world is None or streak >= spec.get("streak", 3))
            and ("until_file" not in spec or os.path.exists(spec["until_file"]))):
        break
    # Waiting for a replacement is bounded by time, not steps: under a loaded host a survivor once took
    # 10x the steps (4 s) before the replacement, slower to start, asked for its first quorum.
    if time.time() - started > spec.get("max_seconds", 25.0):
        log(gave_up=True)
        break

record = opt.fault_tolerance.record
log(done=True, step=manager.current_step(), committed=record.committed, discarded=record.discarded, heals=record.heals)
manager.shutdown(wait=True)
out.close()
