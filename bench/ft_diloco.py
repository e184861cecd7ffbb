"""DiLoCo under fault tolerance, measured: torchft's own ``DiLoCo`` against distopt's.

    RUST_LOG=warn PYTHONPATH=. python bench/ft_diloco.py [--replicas 2] [--sync-every 16] [--syncs 4] [--rounds 3]
        [--kill-trials 2] [--contenders torchft,torchft-bucketized,distopt]

Needs torchft (``pip install -e ".[ft]"``; measured with torchft 0.2.0). Both contenders train
the same thing on loopback: ``--replicas`` replica processes (one each, gloo, distopt's
``make_manager``) and a lighthouse in this process, the char-level LM of the link benchmark
(``distopt.benchmark.slow_link.tasks.TASKS["charlm"]``: a 0.83 M-parameter transformer, 3.2 MiB of
float32 parameters, on the standard library's sources), every replica on its own shard,
AdamW inside, outer SGD (lr 0.7, momentum 0.9, Nesterov), ``sync_every`` H, the same seeds,
the same initial parameters on every replica (so the Manager runs with ``init_sync=False``:
nobody heals at the start) and ``syncs * H`` inner steps:

* ``torchft``: ``torchft.local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=H)`` as a
  context manager around the loop; it requires ``use_async_quorum=False`` (refused otherwise),
  and the model and inner optimizer are registered with ``manager.register_state_dict_fn``
  (what a replica that heals would receive; DiLoCo registers only its backup and outer optimizer).
* ``distopt``: ``DistributedOptimizer(inner, fault_tolerance=manager, sync_every=H,
  outer_optimizer=...)`` with the Manager's defaults (asynchronous quorum).

Reported per contender, the median over ``--rounds`` runs (contenders alternate, the host is
shared: read the spread): a local step (zero_grad to the end of ``step()``) and its ``step()``;
a sync's ``step()`` (the outer step: quorum, all-reduce of the pseudo-gradients, commit vote,
outer optimizer), taken on the replica that reached the sync last, so that waiting for a slower
peer does not count, median over the syncs after the first (the first also connects the
group); the all-reduce calls and bytes handed to the process group per sync (counted by
wrapping ``manager._pg.allreduce``, which both go through); the training loss averaged over the
last H steps and replicas; the validation loss of the global model (the parameters at the last
sync) after the run; whether every replica's global model and outer momentum end bitwise alike.

Then ``--kill-trials`` runs per contender where the last replica SIGKILLs itself inside the
second sync (right after issuing its first all-reduce) and the others go on alone (the
lighthouse then forms quorums of one and drops the dead replica 300 ms after its last
heartbeat): the survivors' failed sync ``step()`` and the seconds from the death to their
next committed sync (H - 1 local steps later for both). Results: docs/dev/fault-tolerance-notes.md.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("torchft", "torchft-bucketized", "distopt")
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)
SEED = 0
os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse in this process logs every quorum at INFO otherwise
# The replicas must import this worktree's distopt, whatever the environment's install points at.
ENV = dict(os.environ, RUST_LOG="warn", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


# ---------------------------------------------------------------------------------------------- one replica


def worker(spec: Dict[str, Any]) -> None:
    """One replica: train ``spec["steps"]`` steps with ``spec["contender"]``, write JSON lines to ``spec["out"]``."""
    import torch
    import torch.distributed as dist

    import distopt
    from distopt.benchmark.slow_link.tasks import TASKS
    from distopt.fault_tolerance.manager import make_manager

    torch.set_num_threads(1)  # one core per replica: the replicas share the host's cores
    out = open(spec["out"], "w", buffering=1)
    replica, replicas, contender, sync_every = spec["replica"], spec["replicas"], spec["contender"], spec["sync_every"]
    task = TASKS["charlm"]
    val = task.val_batches()

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = make_manager(
        replica_id=f"replica_{replica}", lighthouse=spec["lighthouse"], store_addr="127.0.0.1", store_port=store.port,
        hostname="127.0.0.1", timeout=30.0, quorum_timeout=120.0, rank=0, world_size=1,
        min_replicas=spec["min_replicas"],
        # The same seed on every replica: no replica needs the primary's parameters at step 0.
        init_sync=False,
        # torchft's DiLoCo refuses an asynchronous quorum; distopt runs with the Manager's default.
        use_async_quorum=contender == "distopt",
    )
    calls, sent, voting = [0], [0], [0.0]
    group = manager._pg
    allreduce = group.allreduce

    def counted(tensors: List[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        work = allreduce(tensors, *args, **kwargs)
        if spec["kill"] and manager.current_step() >= 1:  # inside the second sync, its first all-reduce under way
            out.write(json.dumps(dict(dying=manager.current_step(), t=time.time())) + "\n")
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return work

    group.allreduce = counted  # both contenders' pseudo-gradients go through the manager's group
    should_commit = manager.should_commit

    def timed_vote(*args: Any, **kwargs: Any) -> bool:
        t = time.perf_counter()
        try:
            return should_commit(*args, **kwargs)
        finally:
            voting[0] += time.perf_counter() - t

    manager.should_commit = timed_vote  # the commit vote: the same RPC for both

    torch.manual_seed(SEED)  # the same initial parameters on every replica and for both contenders
    model = task.build_model()
    inner = task.make_optimizer(model.parameters())

    def outer_factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, **OUTER)

    if contender.startswith("torchft"):
        from torchft.local_sgd import DiLoCo

        # What a replica that heals receives besides DiLoCo's own backup and outer optimizer.
        manager.register_state_dict_fn(
            "model", lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
            lambda: {"model": model.state_dict(), "inner": inner.state_dict()})
        outer = outer_factory(model.parameters())
        # Bucketized: the pseudo-gradients copied into buckets of up to 1 GiB (here one), one all-reduce each.
        context: Any = DiLoCo(manager, [model], inner, outer, sync_every=sync_every,
                              use_bucketization=contender == "torchft-bucketized")
        stepper: Any = inner
    else:
        stepper = distopt.DistributedOptimizer(inner, fault_tolerance=manager, sync_every=sync_every,
                                               outer_optimizer=outer_factory)
        context = contextlib.nullcontext()

    # Start together: the lighthouse admits a replica it has heard from (heartbeats) into a quorum within its
    # join timeout, but one still importing torch may be left out of the first sync.
    ready = [Path(spec["dir"]) / f"{contender}{r}.ready" for r in range(replicas)]
    ready[replica].touch()
    deadline = time.time() + 120
    while not all(path.exists() for path in ready):
        if time.time() > deadline:
            raise TimeoutError("the other replicas did not start within 120 s")
        time.sleep(0.01)
    losses: List[float] = []
    with context:
        for step in range(spec["steps"]):
            x, y = task.batch(replica, replicas, step, SEED)
            before = (calls[0], sent[0], voting[0])
            t0 = time.perf_counter()
            stepper.zero_grad()
            loss = task.loss_fn(model(x), y)
            loss.backward()
            t1 = time.perf_counter()
            stepper.step()
            t2 = time.perf_counter()
            losses.append(loss.item())
            out.write(json.dumps(dict(step=step, loss=losses[-1], total=t2 - t0, step_s=t2 - t1,
                                      calls=calls[0] - before[0], bytes=sent[0] - before[1],
                                      vote=voting[0] - before[2],
                                      committed=manager.current_step(), t=time.time())) + "\n")

    # The global model: the parameters at the last sync, and the outer optimizer's momentum.
    if contender.startswith("torchft"):
        fragment = context._fragments[0]
        anchors = [fragment.original_parameters[name] for name, _ in model.named_parameters()]
        momenta = [outer.state[p]["momentum_buffer"] for p in model.parameters() if p in outer.state]
    else:
        mine = stepper.state_dict()["distopt_local_sgd"]
        anchors = list(mine["anchors"])
        momenta = [s["momentum_buffer"] for s in mine["outer"]["state"].values()]
    digest = hashlib.sha256()
    for t in anchors + momenta:
        digest.update(t.detach().contiguous().numpy().tobytes())
    global_model = copy.deepcopy(model)
    with torch.no_grad():
        for p, a in zip(global_model.parameters(), anchors):
            p.copy_(a)
        val_loss = statistics.fmean(task.loss_fn(global_model(x), y).item() for x, y in val)
    out.write(json.dumps(dict(final=True, digest=digest.hexdigest()[:16], val_loss=val_loss,
                              params=sum(p.numel() for p in model.parameters()),
                              committed=manager.current_step())) + "\n")
    out.close()
    manager.shutdown(wait=False)


# ---------------------------------------------------------------------------------------------- the job


def run_job(contender: str, replicas: int, sync_every: int, steps: int, tmp: Path,
            kill: bool = False) -> List[List[Dict[str, Any]]]:
    """Start a lighthouse and the replicas, wait for them; each replica's JSON lines.

    With ``kill``, the last replica SIGKILLs itself inside the second sync and the others go on.
    """
    from torchft._torchft import LighthouseServer

    # Without a kill, min_replicas = all of them: no quorum can form without a replica that starts late.
    # With one, the survivors must form quorums alone; the dead replica is dropped 300 ms after its last
    # heartbeat (the timeouts of docs/fault-tolerance.md).
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1 if kill else replicas, join_timeout_ms=1000,
                                  quorum_tick_ms=10, heartbeat_timeout_ms=300 if kill else 5000)
    procs: List[subprocess.Popen] = []
    try:
        for r in range(replicas):
            spec = dict(contender=contender, replica=r, replicas=replicas, sync_every=sync_every, steps=steps,
                        kill=kill and r == replicas - 1, min_replicas=1 if kill else replicas,
                        lighthouse=lighthouse.address(), out=str(tmp / f"{contender}{r}.jsonl"), dir=str(tmp))
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                          env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{contender}{r}.err", "w")))
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:  # never leave a replica behind, whatever went wrong
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    logs = []
    for r, p in enumerate(procs):
        path = tmp / f"{contender}{r}.jsonl"
        lines = [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []
        if kill and r == replicas - 1 and p.returncode == -signal.SIGKILL and any("dying" in e for e in lines):
            logs.append(lines)
            continue
        if p.returncode != 0 or not lines or not lines[-1].get("final"):
            err = (tmp / f"{contender}{r}.err").read_text()[-3000:]
            raise RuntimeError(f"{contender} replica {r} exited {p.returncode}:\n{err}")
        logs.append(lines)
    return logs


def summarize(logs: List[List[Dict[str, Any]]], sync_every: int) -> Dict[str, Any]:
    """One run's figures (see the module's docstring)."""
    steps = [[e for e in log if "step" in e] for log in logs]
    finals = [log[-1] for log in logs]
    local = [e for rep in steps for e in rep if e["calls"] == 0]
    sync_idx = sorted({e["step"] for rep in steps for e in rep if e["calls"] > 0})
    # Per sync, the replica that came last waited for nobody: the smaller of the replicas' step() times.
    last = [min((rep[i] for rep in steps), key=lambda e: e["step_s"]) for i in sync_idx]
    syncs = [e["step_s"] for e in last]
    per_sync = [e for e in steps[0] if e["calls"] > 0]
    return dict(
        local_total=statistics.median(e["total"] for e in local),
        local_step=statistics.median(e["step_s"] for e in local),
        sync_step=statistics.median(syncs[1:]) if len(syncs) > 1 else float("nan"),
        first_sync=syncs[0] if syncs else float("nan"),
        vote=statistics.median(e["vote"] for e in last[1:]) if len(last) > 1 else float("nan"),
        syncs=len(sync_idx), sync_steps=sync_idx, committed=finals[0]["committed"],
        calls=statistics.median(e["calls"] for e in per_sync), bytes=statistics.median(e["bytes"] for e in per_sync),
        train_loss=statistics.fmean(e["loss"] for rep in steps for e in rep[-sync_every:]),
        val_loss=finals[0]["val_loss"], identical=len({f["digest"] for f in finals}) == 1,
        params=finals[0]["params"],
    )


def summarize_kill(logs: List[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """A run with a kill: the survivors' failed sync, and the time from the death to their next committed sync."""
    death = next(e for e in logs[-1] if "dying" in e)
    out: Dict[str, Any] = dict(failed=[], next=[], local_steps=[], committed=[], identical=True)
    for log in logs[:-1]:
        steps = [e for e in log if "step" in e]
        failed = next(e for e in steps if e["calls"] > 0 and e["t"] > death["t"])  # the sync it died in
        nxt = next(e for e in steps if e["committed"] > death["dying"])
        out["failed"].append(failed["step_s"])
        out["next"].append(nxt["t"] - death["t"])
        out["local_steps"].append(nxt["step"] - failed["step"] - 1)
        out["committed"].append(log[-1]["committed"])
    out["identical"] = len({log[-1]["digest"] for log in logs[:-1]}) == 1
    return out


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=4, help="inner steps = syncs * sync_every")
    parser.add_argument("--rounds", type=int, default=3, help="runs per contender, alternating")
    parser.add_argument("--kill-trials", type=int, default=2,
                        help="runs per contender where a replica dies inside the second sync")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"a subset of {','.join(CONTENDERS)}")
    args = parser.parse_args()
    contenders = tuple(c for c in CONTENDERS if c in args.contenders.split(","))
    # One more than syncs * H: torchft syncs after steps H, 2H, ..., distopt after step 1 (a fault-tolerant
    # process's first step ends with a sync) and then 1 + H, 1 + 2H, ...: so each global model misses at
    # most one inner step (torchft's the last one), and the two see as many training batches.
    steps = args.syncs * args.sync_every + 1
    print(f"at start: {uptime()}")
    print(f"{args.replicas} replicas, charlm, AdamW inner, SGD outer {OUTER}, H={args.sync_every}, {steps} inner steps")
    results: Dict[str, List[Dict[str, Any]]] = {c: [] for c in contenders}
    for k in range(args.rounds):
        for contender in (contenders if k % 2 == 0 else contenders[::-1]):  # alternate who goes first
            with tempfile.TemporaryDirectory() as d:
                t0 = time.time()
                s = summarize(run_job(contender, args.replicas, args.sync_every, steps, Path(d)), args.sync_every)
            results[contender].append(s)
            print(f"  round {k + 1} {contender:8s} ({time.time() - t0:.0f} s): local step {s['local_total'] * 1e3:.1f} ms "
                  f"(step() {s['local_step'] * 1e3:.2f} ms), sync step() {s['sync_step'] * 1e3:.1f} ms "
                  f"(first {s['first_sync'] * 1e3:.0f} ms, commit vote {s['vote'] * 1e3:.1f} ms), {s['calls']:.0f} all-reduces / {s['bytes'] / 2**20:.2f} MiB "
                  f"per sync at steps {s['sync_steps']}, {s['committed']} committed, train loss {s['train_loss']:.4f}, "
                  f"val loss {s['val_loss']:.4f}, replicas identical: {s['identical']}", flush=True)
    if args.kill_trials:
        print(f"a replica SIGKILLed inside the second sync (its first all-reduce issued), "
              f"{args.kill_trials} trials per contender, alternating:")
    kills: Dict[str, List[Dict[str, Any]]] = {c: [] for c in contenders}
    for k in range(args.kill_trials):
        for contender in (contenders if k % 2 == 0 else contenders[::-1]):
            with tempfile.TemporaryDirectory() as d:
                s = summarize_kill(run_job(contender, args.replicas, args.sync_every, steps, Path(d), kill=True))
            kills[contender].append(s)
            print(f"  trial {k + 1} {contender:8s}: the survivors' failed sync step() "
                  f"{', '.join(f'{x * 1e3:.0f}' for x in s['failed'])} ms; next committed sync "
                  f"{', '.join(f'{x:.2f}' for x in s['next'])} s after the death, {s['local_steps'][0]} local steps "
                  f"later; syncs committed at the end {s['committed']}", flush=True)
    print(f"at end: {uptime()}")
    print("\nmedians over rounds (min-max):")
    print("| contender | local step, ms | its step(), ms | sync step(), ms | of which commit vote, ms | all-reduces / MiB per sync "
          "| syncs committed | train loss (last H) | val loss (global model) | replicas bitwise alike |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def cell(runs: List[Dict[str, Any]], key: str, scale: float = 1e3, fmt: str = ".1f") -> str:
        xs = [r[key] * scale for r in runs]
        return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

    for c, runs in ((c, runs) for c, runs in results.items() if runs):
        print(f"| {c} | {cell(runs, 'local_total')} | {cell(runs, 'local_step', fmt='.2f')} | {cell(runs, 'sync_step')} | {cell(runs, 'vote')} "
              f"| {runs[0]['calls']:.0f} / {runs[0]['bytes'] / 2**20:.2f} | {runs[0]['committed']} "
              f"| {cell(runs, 'train_loss', 1, '.4f')} | {cell(runs, 'val_loss', 1, '.4f')} "
              f"| {all(r['identical'] for r in runs)} |")


if __name__ == "__main__":
    main()
