"""Fault tolerance, measured: recovery after a death, steady-state overhead, and a full restart for comparison.

    RUST_LOG=warn python bench/fault_tolerance.py [--trials 3] [--width 512] [--steps 300]

Needs torchft (``pip install -e ".[ft]"``). Every figure comes from real processes on this
machine (gloo on loopback), with the lighthouse timeouts of docs/fault-tolerance.md
(heartbeat every 50 ms, dropped after 300 ms, join timeout 200 ms, quorum tick 10 ms):

1. **Recovery.** 3 replicas (tests/_scripts/ft_worker.py, an MLP with Adam); one SIGKILLs
   itself inside backward (packs in flight) or between steps. Reported: seconds from the
   death to each survivor's next committed step (the slower survivor counts), committed
   steps lost (a gap in the survivors' step counts), and steps discarded.
2. **Overhead.** The same model and loop at 2 processes: plain distopt (``distopt.launch``,
   gloo) against 2 fault-tolerant replicas; median seconds per step (zero_grad to the end of
   step), after 30 warm-up steps.
3. **Restart from a checkpoint.** The plain job at 3 processes, checkpointing every 10 steps;
   one process is SIGKILLed at step 25, the job is torn down and started again from the
   checkpoint, as torchrun does: seconds from the death to the next step, and steps lost.
"""
from __future__ import annotations

import argparse
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
WORKER = ROOT / "tests" / "_scripts" / "ft_worker.py"
LIGHTHOUSE = dict(min_replicas=1, join_timeout_ms=200, quorum_tick_ms=10, heartbeat_timeout_ms=300)
os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse in this process logs every quorum at INFO otherwise
ENV = dict(os.environ, RUST_LOG="warn", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def read(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def ft_job(tmp: Path, replicas: int, spec: Dict[str, Any], kills: Dict[int, Dict[str, Any]]) -> Dict[int, List[Dict[str, Any]]]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", **LIGHTHOUSE)
    procs = {}
    try:
        for r in range(replicas):
            s = dict(spec, replica=r, lighthouse=lighthouse.address(), out=str(tmp / f"r{r}.jsonl"))
            if r in kills:
                s["kill"] = kills[r]
            procs[r] = subprocess.Popen([sys.executable, str(WORKER), json.dumps(s)], env=ENV,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r, p in procs.items():
            p.wait(timeout=180)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    return {r: read(tmp / f"r{r}.jsonl") for r in procs}


def recovery(trials: int) -> None:
    print("1. recovery after a death (3 replicas, one SIGKILLs itself at step 15)")
    for where in ("backward", "between"):
        times, lost, discarded = [], [], []
        for trial in range(trials):
            with tempfile.TemporaryDirectory() as d:
                logs = ft_job(Path(d), 3, dict(steps=40, pace=0.02, until_world=2, streak=3, timeout=5.0),
                              {1: {"step": 15, "where": where, "world": 3}})
            death = next(e for e in logs[1] if "dying" in e)
            worst = 0.0
            for r in (0, 2):
                steps = [e for e in logs[r] if "digest" in e]
                nxt = next(e for e in steps if e["t"] > death["t"] and e["step"] > death["step"])
                worst = max(worst, nxt["t"] - death["t"])
                counts = sorted({e["step"] for e in steps})
                lost.append(len(range(counts[0], counts[-1] + 1)) - len(counts))
                discarded.append(steps[-1]["discarded"])
            times.append(worst)
        print(f"   death {'inside backward (packs in flight)' if where == 'backward' else 'between steps'}: "
              f"next committed step {', '.join(f'{t:.3f}' for t in times)} s after it (median "
              f"{statistics.median(times):.3f}); committed steps lost {max(lost)}; steps discarded per survivor "
              f"{sorted(set(discarded))}")


def plain_train(width: int, steps: int, batch: int = 32) -> List[float]:
    """One rank of the plain distopt job, timed like the fault-tolerant worker's steps."""
    import torch

    import distopt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, 1))
    opt = distopt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), pack_threshold=4096)
    target = torch.randn(16, generator=torch.Generator().manual_seed(7))
    rank = torch.distributed.get_rank()
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randn(batch, 16, generator=g)
        y = torch.tanh(x @ target).unsqueeze(1)
        t0 = time.time()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        out.append(time.time() - t0)
    return out


def plain_steps(width: int, steps: int, batch: int) -> List[float]:
    import distopt
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fault_tolerance as this  # importable by the spawned workers, unlike __main__

    return distopt.launch(this.plain_train, nprocs=2, args=(width, steps, batch))[0]


def overhead(width: int, steps: int, rounds: int, batch: int) -> None:
    mib = (16 * width + width * width + width + 2 * width + 1) * 4 / 2**20
    print(f"2. steady-state overhead (2 processes, MLP 16-{width}-{width}-1 ({mib:.1f} MiB of gradients), batch "
          f"{batch}, Adam, pack_threshold 4 KiB, {steps} steps, median after 30; rounds alternate plain and "
          "fault-tolerant, the host is shared and noisy: read the median ratio)")
    ratios = []
    for k in range(rounds):
        plain = statistics.median(plain_steps(width, steps, batch)[30:])
        with tempfile.TemporaryDirectory() as d:
            logs = ft_job(Path(d), 2, dict(steps=steps, pace=0.0, width=width, batch=batch, until_world=2, streak=1,
                                                  digest=False),
                          {})
        ft = statistics.median([e["dt"] for e in logs[0] if "dt" in e][30:])
        ratios.append(ft / plain)
        print(f"   round {k + 1}: plain distopt {plain * 1e3:.2f} ms/step, fault-tolerant {ft * 1e3:.2f} ms/step: "
              f"{ft / plain:.3f}x")
    print(f"   median ratio over {rounds} rounds: {statistics.median(ratios):.3f}x")


def restart(tmp: Path) -> None:
    print("3. a full restart from a checkpoint (plain distopt, 3 processes, a checkpoint every 10 steps, "
          "SIGKILL at step 25)")
    script = Path(__file__).resolve()
    ckpt, log = tmp / "ckpt.pt", tmp / "plain.jsonl"

    def job(port: int, kill: bool) -> List[subprocess.Popen]:
        env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3")
        return [subprocess.Popen([sys.executable, str(script), "--plain-worker", str(ckpt), str(log),
                                  "25" if kill and r == 1 else "0"], env=dict(env, RANK=str(r)),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(3)]

    first = job(29731, kill=True)
    while all(p.poll() is None for p in first):
        time.sleep(0.01)
    for p in first:  # the agent tears the job down...
        if p.poll() is None:
            p.kill()
        p.wait()
    second = job(29732, kill=False)  # ...and starts it again, from the checkpoint
    for p in second:
        p.wait(timeout=120)
    entries = read(log)
    death = next(e for e in entries if "dying" in e)
    resumed = [e for e in entries if e.get("resumed_from") is not None][-1]  # the second job's
    nxt = next(e for e in entries if "step" in e and e["t"] > death["t"] and e.get("rank") == 0)
    print(f"   next step {nxt['t'] - death['t']:.3f} s after the death (process start, rendezvous, checkpoint "
          f"load, one step); committed steps lost: {death['step'] - resumed['resumed_from']} (steps since the "
          "last checkpoint)")


def plain_worker(ckpt: str, log: str, kill_at: int) -> None:
    import torch

    import distopt
    distopt.init()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    opt = distopt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), pack_threshold=4096)
    start = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    out = open(log, "a", buffering=1)
    if rank == 0:
        out.write(json.dumps({"resumed_from": start, "t": time.time()}) + "\n")
    target = torch.randn(16, generator=torch.Generator().manual_seed(7))
    for step in range(start + 1, 41):
        if step == kill_at:
            out.write(json.dumps({"dying": "between", "step": step - 1, "t": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target).unsqueeze(1)).backward()
        opt.step()
        out.write(json.dumps({"rank": rank, "step": step, "t": time.time()}) + "\n")
        if step % 10 == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
        time.sleep(0.02)
    distopt.shutdown()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--plain-worker":
        plain_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--only", choices=["recovery", "overhead", "restart"])
    args = parser.parse_args()
    if args.only in (None, "recovery"):
        recovery(args.trials)
    if args.only in (None, "overhead"):
        overhead(args.width, args.steps, args.rounds, args.batch)
    if args.only in (None, "restart"):
        with tempfile.TemporaryDirectory() as d:
            restart(Path(d))


if __name__ == "__main__":
    main()
