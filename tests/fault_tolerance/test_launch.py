"""``python -m distopt.fault_tolerance.launch`` as documented, with a worker SIGKILLed mid-training.

The launcher starts a lighthouse and one torchrun agent per replica; the test kills one
replica's worker from outside, as a user or the kernel would, and reads the replicas' step
logs (``tests/_scripts/ft_launched.py``). The kill runs across the network-namespace hosts of
``tests/_hosts.py`` (on this one where they cannot be built), beside the example's one-host
run, in one module fixture: most of either's time is process start-up and waiting.
Skipped, with the reason, where torchft is not installed (``pip install -e ".[ft]"``).
"""
from __future__ import annotations

import contextlib
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Tuple

import pytest

pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[ft]' (torchft==0.2.0)")
psutil = pytest.importorskip("psutil")

from distopt._testing import kill_tree, run_command  # noqa: E402

from _hosts import HostsUnavailable, network_hosts, start_on  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "_scripts" / "ft_launched.py"
ISLANDS = ROOT / "tests" / "_scripts" / "ft_islands.py"
EXAMPLE = ROOT / "examples" / "train_ft.py"
# docs/fault-tolerance.md's example, in streaming DiLoCo: 8 committed fragment syncs, one every 2 local steps
EXAMPLE_ARGS = ["--steps", "8", "--sync-every", "4", "--fragments", "2", "--overlap", "1"]
# Two hosts: replicas 0 and 1 on host A, 2 on host B. One host: two replicas, enough for a survivor
# and a replacement (every replica is three fresh interpreters, and the suite's time is mostly those).
REPLICAS, ONE_HOST_REPLICAS, STEPS = 3, 2, 20
DEADLINE = 90  # seconds for the whole launch; it takes ~10-20 s


def _logs(out: Path) -> Dict[str, List[Dict[str, Any]]]:
    """``replica<R>-<pid>`` (``island<R>-rank<J>-<pid>``) -> its lines, for every worker process that has started."""
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
            for path in sorted(out.glob("*.jsonl"))}


def _steps(lines: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [line for line in lines if "digest" in line]


def _launch_and_kill(launchers: List[subprocess.Popen], out: Path, replicas: int,
                     victim_log: str = "") -> Tuple[Any, float, List[str], List[Any]]:
    """Wait for the launch(es) to end, SIGKILLing the last replica's worker once all replicas trained together
    (the worker whose log starts with ``victim_log``: default, the last replica's).

    Returns ``(victim, killed_at, outputs, processes)``: the killed process (None if never), when,
    each launcher's output, and every process the launchers started.
    """
    seen: Dict[int, Any] = {}  # every process the launch started: none may outlive it

    def look() -> None:
        for launcher in launchers:
            try:
                for child in psutil.Process(launcher.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass

    victim, killed_at = None, 0.0
    try:
        deadline = time.monotonic() + DEADLINE
        polls = 0
        while any(launcher.poll() is None for launcher in launchers) and time.monotonic() < deadline:
            # A look every 0.1 s: each reads every process's /proc entry (5-10 ms for the machine's
            # hundred-odd), and every 0.02 s the looks cost this process 3 s more CPU over the file's
            # two launches, taken from the launches on the same cores. Every process of a launch
            # (interpreters, agents, the lighthouse) lives for seconds, so each is still seen.
            if polls % 5 == 0:
                look()
            polls += 1
            if victim is None:
                logs = _logs(out)
                mine = next((lines for name, lines in logs.items()
                             if name.startswith(victim_log or f"replica{replicas - 1}-")), [])
                # all in the step: a kill that lands before the others joined would test nothing
                if sum(1 for line in _steps(mine) if line["world"] == replicas) >= 3:
                    victim = psutil.Process(mine[0]["pid"])
                    command = " ".join(victim.cmdline())
                    assert str(SCRIPT) in command or str(ISLANDS) in command, command
                    (out / "killed").touch()  # the survivors' drop in world from now on is the kill's
                    victim.send_signal(signal.SIGKILL)
                    killed_at = time.time()
            time.sleep(0.02)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_tree(launcher.pid)
        outputs = [launcher.communicate()[0] for launcher in launchers]
    return victim, killed_at, outputs, list(seen.values())


Launch = Tuple[List[subprocess.Popen], Path, int, Tuple[Any, float, List[str], List[Any]]]


def _launched(start: Callable[[Path], List[subprocess.Popen]], out: Path, replicas: int) -> Launch:
    """Start the launcher(s) of ``replicas`` replicas, logs in ``out``; kill the last one's worker; wait for the end."""
    out.mkdir()
    launchers = start(out)
    return launchers, out, replicas, _launch_and_kill(launchers, out, replicas)


def _check_killed_and_healed(launch: Launch) -> None:
    """The launch ended by itself, every agent exited 0, the survivors went on, the killed one healed."""
    launchers, out, replicas, (victim, killed_at, outputs, processes) = launch
    killed = replicas - 1
    logs = _logs(out)
    summary = "".join(f"launcher output:\n{output[-3000:]}\n" for output in outputs)
    summary += f"logs: {json.dumps({n: l[-2:] for n, l in logs.items()})}"
    assert all(launcher.returncode is not None for launcher in launchers), summary
    assert victim is not None, f"replica {killed} never trained with all {replicas} replicas\n{summary}"
    # the first non-zero agent's code: every agent exited 0 (and no launch was killed at the deadline)
    assert all(launcher.returncode == 0 for launcher in launchers), summary

    by_replica: Dict[int, List[str]] = {}
    for name in logs:
        by_replica.setdefault(int(name.split("-")[0][len("replica"):]), []).append(name)
    for name, lines in logs.items():
        assert lines[0]["distopt"].startswith(str(ROOT)), lines[0]  # this checkout's distopt, not an install
        assert not any(line.get("gave_up") for line in lines), (name, lines[-3:])
    # the survivors: one process each, never restarted, committing on through the death
    for replica in set(range(replicas)) - {killed}:
        (name,) = by_replica[replica]
        lines = logs[name]
        assert lines[0]["restart"] == 0 and lines[-1].get("done"), (name, lines[-3:])
        steps = [line["step"] for line in _steps(lines)]
        # a step the kill broke is discarded and taken again under the same count: never back, none missing
        assert steps == sorted(steps) and sorted(set(steps)) == list(range(steps[0], steps[-1] + 1)), (name, steps)
        assert any(line["world"] == replicas - 1 for line in _steps(lines) if line["t"] > killed_at), (name, lines)
    # the killed one: its agent started it again (restart 1), and it healed from a live peer
    first, again = sorted(by_replica[killed], key=lambda n: logs[n][0]["restart"])
    assert logs[first][0]["pid"] == victim.pid and not logs[first][-1].get("done"), logs[first][-3:]
    assert logs[again][0]["restart"] == 1, logs[again][0]
    done = logs[again][-1]
    assert done.get("done") and done["heals"] >= 1, done
    # bitwise equal to the survivors from its first step on, and all end together
    digests: Dict[int, set] = {}
    for lines in logs.values():
        for line in _steps(lines):
            digests.setdefault(line["step"], set()).add(line["digest"])
    assert all(len(d) == 1 for d in digests.values()), {s: d for s, d in digests.items() if len(d) > 1}
    first_step = _steps(logs[again])[0]["step"]
    assert len([n for n in logs if any(line["step"] == first_step for line in _steps(logs[n]))]) == replicas
    assert len({logs[n][-1]["step"] for n in logs if n != first}) == 1, {n: logs[n][-1] for n in logs}
    # nothing left behind: not the lighthouse, not an agent, not a worker
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"pid {process.pid}: {' '.join(process.cmdline())[:150]}")
        except psutil.NoSuchProcess:
            pass
    assert not left, left


#: Islands: 2 replicas of 2 ranks each (--nproc-per-node 2); rank 1 of island 1 is killed.
ISLAND_STEPS = 10
#: The lighthouse drops the dead island this long after its last heartbeat: below 1 s, and long enough that a
#: loaded host does not drop the survivor while the replacement asks for its first quorum (a split brain).
ISLAND_HEARTBEAT_TIMEOUT_MS = 500
#: Seconds from the kill to the survivor island's first commit without the dead one: the goal is 1 s (0.45 s
#: measured with 300 ms heartbeats, docs/fault-tolerance.md); the suite's load gets some slack.
ISLAND_RECOVERY_LIMIT = 1.5


def _islands(out: Path) -> List[subprocess.Popen]:
    """The launcher as docs/fault-tolerance.md runs islands: one torchrun agent of 2 workers per island."""
    command = [sys.executable, *_launch_args(2), "--nproc-per-node", "2", "--heartbeat-timeout-ms",
               str(ISLAND_HEARTBEAT_TIMEOUT_MS), str(ISLANDS), str(out), str(ISLAND_STEPS)]
    return [subprocess.Popen(command, cwd=out.parent, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)]


def _launched_islands(out: Path) -> Launch:
    out.mkdir()
    launchers = _islands(out)
    return launchers, out, 2, _launch_and_kill(launchers, out, 2, victim_log="island1-rank1-")


def _launch_args(replicas: int) -> List[str]:
    return ["-m", "distopt.fault_tolerance.launch", "--replicas", str(replicas), "--max-restarts", "1"]


# For the host that starts the lighthouse: under the suite's load the default 300 ms let a replacement
# be given quorums of its own (docs/fault-tolerance.md, "Split brain").
PATIENT_LIGHTHOUSE = ["--heartbeat-timeout-ms", "1000"]


def _env() -> Dict[str, str]:
    return dict(os.environ, RUST_LOG="warn", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                   os.environ.get("PYTHONPATH")])))


def _one_host(out: Path) -> List[subprocess.Popen]:
    command = [sys.executable, *_launch_args(ONE_HOST_REPLICAS), *PATIENT_LIGHTHOUSE, str(SCRIPT), str(out),
               str(STEPS)]
    return [subprocess.Popen(command, cwd=out.parent, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)]


def _two_hosts(hosts: List[Tuple[str, str, str]]) -> Callable[[Path], List[subprocess.Popen]]:
    """Host A: the lighthouse and replicas 0 and 1; host B: replica 2 (the one killed), naming A's lighthouse."""
    (ns_a, host_a, addr_a), (ns_b, host_b, addr_b) = hosts
    port = 29617

    def start(out: Path) -> List[subprocess.Popen]:
        env = dict(os.environ, RUST_LOG="warn")
        return [
            # Three replicas, one killed: a quorum takes two, so the restarted one can never be given one of
            # its own (docs/fault-tolerance.md, "Split brain"). The one-host run has two, and keeps one.
            start_on(ns_a, host_a, *_launch_args(REPLICAS), *PATIENT_LIGHTHOUSE, "--min-replicas", 2, "--replica-ids",
                     ",".join(map(str, range(REPLICAS - 1))), "--port", port, "--hostname", addr_a, SCRIPT, out, STEPS,
                     env=env),
            start_on(ns_b, host_b, *_launch_args(REPLICAS), "--replica-ids", REPLICAS - 1, "--lighthouse",
                     f"http://{addr_a}:{port}", "--hostname", addr_b, SCRIPT, out, STEPS, env=env),
        ]

    return start


@pytest.fixture(scope="module")
def launches(tmp_path_factory: Any) -> Dict[str, Any]:
    """``{"kill": Launch, "two hosts": the same Launch or the reason there are none, "example": ...}``.

    The kill, restart and heal run once: across the two hosts where they can be built (host A's
    launcher is the one-host command with ``--replica-ids``), else on this one with 2 replicas. The
    example runs the one-host command beside it. Each launch is a dozen fresh interpreters.
    """
    base = tmp_path_factory.mktemp("ft-launch")
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(network_hosts())
        except HostsUnavailable as exc:
            hosts, unavailable = None, str(exc)
        with ThreadPoolExecutor(2) as pool:
            if hosts is not None:
                kill = pool.submit(_launched, _two_hosts(hosts), base / "two-hosts", REPLICAS)
            else:
                kill = pool.submit(_launched, _one_host, base / "one-host", ONE_HOST_REPLICAS)
            example = pool.submit(run_command, [sys.executable, "-m", "distopt.fault_tolerance.launch", "--replicas",
                                                "2", EXAMPLE, *EXAMPLE_ARGS], base, _env(), DEADLINE)
            launch = kill.result()
            return {"kill": launch, "two hosts": launch if hosts is not None else unavailable,
                    "example": example.result()}


@pytest.mark.timeout(DEADLINE + 30)
def test_the_launcher_restarts_a_killed_worker_which_heals_while_the_others_go_on(launches: Dict[str, Any]) -> None:
    _check_killed_and_healed(launches["kill"])


@pytest.mark.timeout(DEADLINE + 30)
def test_a_killed_rank_takes_its_island_out_which_restarts_and_heals_while_the_other_island_commits_on(
        tmp_path: Path) -> None:
    """``--replicas 2 --nproc-per-node 2`` with ``mode=distopt.Islands()``: rank 1 of island 1 is SIGKILLed.

    Island 0 commits its next step without island 1 within the recovery limit and is never
    restarted; island 1's agent restarts both of its workers, each heals from the live island, and
    every rank of both islands is bitwise equal at every step, the healed island from its first.
    """
    # A launch of its own, not beside the others: its 8 fresh interpreters with theirs overran their deadline.
    launchers, out, _, (victim, killed_at, outputs, processes) = _launched_islands(tmp_path / "islands")
    logs = _logs(out)
    summary = f"launcher output:\n{outputs[0][-3000:]}\nlogs: {json.dumps({n: l[-2:] for n, l in logs.items()})}"
    assert victim is not None, f"island 1 never trained with island 0\n{summary}"
    assert launchers[0].returncode == 0, summary
    by_rank: Dict[Tuple[int, int], List[str]] = {}
    for name in logs:
        island, rank, _ = name.split("-")
        by_rank.setdefault((int(island[len("island"):]), int(rank[len("rank"):])), []).append(name)
    assert sorted(by_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(by_rank)
    for name, lines in logs.items():
        assert not any(line.get("gave_up") for line in lines), (name, lines[-3:])
    # island 0: one process per rank, never restarted, committing on through the death, soon without island 1
    for rank in (0, 1):
        (name,) = by_rank[(0, rank)]
        lines = logs[name]
        assert lines[0]["restart"] == 0 and lines[-1].get("done"), (name, lines[-3:])
        steps = [line["step"] for line in _steps(lines)]
        assert steps == sorted(steps) and sorted(set(steps)) == list(range(steps[0], steps[-1] + 1)), (name, steps)
        alone = next(line for line in _steps(lines) if line["t"] > killed_at and line["world"] == 1)
        assert alone["t"] - killed_at < ISLAND_RECOVERY_LIMIT, (name, alone, killed_at)
    # island 1: its agent restarted both workers (the one killed and the one it stopped), and both healed
    for rank in (0, 1):
        first, again = sorted(by_rank[(1, rank)], key=lambda n: logs[n][0]["restart"])
        assert not logs[first][-1].get("done") and logs[again][0]["restart"] == 1, (logs[first][-2:], logs[again][0])
        assert logs[again][-1].get("done") and logs[again][-1]["heals"] >= 1, logs[again][-1]
    assert logs[sorted(by_rank[(1, 1)], key=lambda n: logs[n][0]["restart"])[0]][0]["pid"] == victim.pid
    # bitwise equal everywhere at every step (the ranks of an island too), the healed island from its first step
    digests: Dict[int, set] = {}
    for lines in logs.values():
        for line in _steps(lines):
            digests.setdefault(line["step"], set()).add(line["digest"])
    assert all(len(d) == 1 for d in digests.values()), {s: d for s, d in digests.items() if len(d) > 1}
    healed = [n for (island, _), names in by_rank.items() if island == 1 for n in names if logs[n][0]["restart"] == 1]
    first_step = _steps(logs[healed[0]])[0]["step"]
    assert len([n for n in logs if any(line["step"] == first_step for line in _steps(logs[n]))]) == 4
    assert len({logs[n][-1]["step"] for n in logs if logs[n][-1].get("done")}) == 1, {n: logs[n][-1] for n in logs}
    left = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


@pytest.mark.timeout(DEADLINE + 30)
def test_across_two_hosts_a_killed_worker_heals_from_a_peer_on_the_other_host(launches: Dict[str, Any]) -> None:
    """Host A runs the lighthouse and replicas 0 and 1, host B replica 2, which is killed and heals across the link.

    The hosts' names resolve nowhere, so this also checks that every address a replica
    advertises (manager, store, checkpoint server) is the ``--hostname`` given, and that
    gloo binds to its interface.
    """
    launch = launches["two hosts"]
    if isinstance(launch, str):
        pytest.skip(f"no two-host launch ran (the kill ran on one host): {launch}")
    _, _, _, (_, _, outputs, _) = launch  # test_the_launcher_restarts_... checks the kill and the heal
    assert all("distopt: gloo and NCCL use interface dv" in output for output in outputs), outputs


@pytest.mark.timeout(DEADLINE + 30)
def test_the_example_trains_streaming_diloco_under_the_launcher(launches: Dict[str, Any]) -> None:
    """examples/train_ft.py as docs/fault-tolerance.md runs it, in streaming DiLoCo on 2 replicas: both
    reach the committed count, together, and the launcher exits 0."""
    code, out, err = launches["example"]
    assert code == 0, out + err
    done = re.findall(r"\[replica (\d)\] done: (\d+) steps, (\d+) committed", out)
    assert sorted(r for r, _, _ in done) == ["0", "1"], out + err
    assert {committed for _, _, committed in done} == {"8"}, done
    # one fragment's sync in flight at a time, launched every 2 local steps: at most one commit per 2 steps
    assert all(int(committed) <= int(steps) // 2 + 1 for _, steps, committed in done), done
