"""distopt.launch / launcher / init / shutdown, with real spawned processes on gloo."""
import contextlib
import importlib.machinery
import json
import re
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import distopt
from distopt import LaunchTimeoutError, WorkerFailedError, launch, launcher
from distopt._testing import assert_no_children, run_torchrun

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROOT = Path(__file__).resolve().parents[2]
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BIG = 8_000_000  # bytes per rank: far more than a pipe buffer holds


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- worker functions (module level: spawned workers import them by name) ---


def _report(tag, *, scale=1):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "tag": tag,
        "env": {name: os.environ[name] for name in ENV_NAMES},
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": total.item() * scale,
        "big": bytes(BIG),
    }


def _fail(mode, bad_rank, stamp):
    if dist.get_rank() == bad_rank:
        Path(stamp).write_text(repr(time.time()))
        if mode == "raise":
            raise ValueError("boom from the bad rank")
        if mode == "exit":
            os._exit(3)
        if mode == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
    # The healthy ranks wait in a collective, as real training would.
    dist.barrier()
    time.sleep(600)


def _hang():
    time.sleep(600)


def _rank_and_world():
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


@launcher(nprocs=3, timeout=120)
def _decorated(x, *, y):
    if dist.get_rank() == 1:
        return None  # a real result: no warning
    if dist.get_rank() == 2:
        sys.exit(0)  # exits cleanly without a value: None and a warning
    return x + y


def _explicit_none():
    return None


# --- tests ---


@pytest.mark.timeout(180)
def test_results_in_rank_order_with_env_group_and_large_results():
    results = launch(_report, 3, args=("t",), kwargs={"scale": 2}, backend="gloo", timeout=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    port = results[0]["env"]["MASTER_PORT"]
    assert int(port) > 0
    for rank, r in enumerate(results):
        assert r["tag"] == "t"
        assert r["world_size"] == 3 and r["backend"] == "gloo"
        assert r["sum"] == 2 * (1 + 2 + 3)
        assert r["env"] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }
        assert len(r["big"]) == BIG
    assert not dist.is_initialized()  # the parent never joins the group


@pytest.mark.timeout(180)
def test_decorator_form_and_worker_exiting_without_value():
    assert _decorated.__name__ == "_decorated" and callable(_decorated.__wrapped__)
    with pytest.warns(UserWarning, match=r"ranks \[2\] exited with code 0 but did not return a value") as record:
        assert _decorated(1, y=2) == [3, None, None]
    assert len(record) == 1  # rank 1 returned None on purpose


def test_bare_decorator_wraps_without_launching():
    def fn():
        pass

    wrapped = launcher(fn)
    assert wrapped.__wrapped__ is fn and wrapped.__name__ == "fn"
    with pytest.raises(TypeError, match="launcher decorates a function"):
        launcher(3)


def test_launcher_is_the_decorator_and_the_code_lives_in_distopt_launching():
    from distopt.launching import init, launch, shutdown

    assert (init, launch, shutdown) == (distopt.init, distopt.launch, distopt.shutdown)
    assert distopt.launcher is distopt.launching.launcher
    assert not isinstance(distopt.launcher, types.ModuleType)
    # No module of that name is left for the decorator to shadow. PathFinder searches the package's own
    # directory only: an editable install's finder could otherwise find another checkout's distopt.
    assert importlib.machinery.PathFinder.find_spec("distopt.launcher", distopt.__path__) is None
    assert distopt.launching.DEFAULT_TIMEOUT > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "mode, bad_rank, check",
    [
        ("raise", 1, lambda e: e.exitcode == 1 and "ValueError: boom from the bad rank" in e.traceback
         and "_fail" in e.traceback and "raised ValueError" in str(e)),
        ("exit", 0, lambda e: e.exitcode == 3 and e.traceback is None and "exited with code 3" in str(e)),
        ("signal", 1, lambda e: e.exitcode == -signal.SIGKILL and e.signal_name == "SIGKILL"
         and "killed by SIGKILL" in str(e)),
    ],
)
def test_failed_worker_stops_all_and_is_named(mode, bad_rank, check, tmp_path):
    stamp = tmp_path / "failed_at"
    with pytest.raises(WorkerFailedError, match=rf"worker rank {bad_rank}") as info:
        launch(_fail, 2, args=(mode, bad_rank, str(stamp)), backend="gloo", timeout=120)
    lag = time.time() - float(stamp.read_text())  # from the failure to every process reaped
    error = info.value
    assert isinstance(error, RuntimeError)
    assert error.rank == bad_rank, str(error)
    assert f"worker rank {bad_rank}" in str(error)
    assert check(error), str(error)
    assert lag < 10, f"the failure took {lag:.1f} s to surface"


@pytest.fixture(scope="module")
def launches_that_wait(tmp_path_factory):
    """The launches that can only end by a timeout, side by side, since each spends seconds idle waiting for
    it: name -> ``(its outcome, as a done Future, seconds to its end)``; ``"port"``: the store's port nobody
    listens on. Every process they started is gone once they end."""
    port = _free_port()
    calls = {
        "hang": lambda: launch(_hang, 1, backend="gloo", timeout=3),
        # 15 s: starting the worker alone takes 2-4 s of it on a loaded 2-core machine (10 s failed once in CI).
        "unreachable store": lambda: launch(_never_called, 1, nnodes=2, node_rank=1, master_addr="127.0.0.1",
                                            master_port=port, timeout=15),
        # Rank 1 never arrives (it waits for rank 0's report), so each collective can only end by its timeout.
        "absent rank": lambda: launch(_wait_for_an_absent_rank, 2, collective_timeout=1.5, timeout=40,
                                      args=(str(tmp_path_factory.mktemp("absent") / "reported"),)),
    }

    def timed(call):
        outcome, start = Future(), time.monotonic()
        try:
            outcome.set_result(call())
        except Exception as exc:
            outcome.set_exception(exc)
        return outcome, time.monotonic() - start

    with ThreadPoolExecutor(len(calls)) as pool:
        ended = {name: pool.submit(timed, call) for name, call in calls.items()}
    assert_no_children()
    return {"port": port, **{name: future.result() for name, future in ended.items()}}


@pytest.mark.timeout(180)
def test_timeout_kills_everything(launches_that_wait):
    outcome, seconds = launches_that_wait["hang"]
    with pytest.raises(LaunchTimeoutError, match=r"timed out after 3 s: ranks \[0\] were still running"):
        outcome.result()
    assert seconds < 3 + 10


@pytest.mark.timeout(180)
def test_keyboard_interrupt_in_parent_stops_workers():
    # Ctrl-C as Python delivers it: a KeyboardInterrupt in the main thread. The handler and the
    # target thread are set here, so that neither the disposition the test run inherited nor
    # earlier tests' threads decide where the signal lands (two full CI runs lost it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):  # no message to match: Python's Ctrl-C carries none
            launch(_hang, 2, backend="gloo", timeout=60)
        assert time.monotonic() - start < 30, "the launch went on after Ctrl-C"
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(180)
def test_multi_node_ranks_are_node_major():
    port = _free_port()
    results = {}

    def node(node_rank):
        results[node_rank] = launch(_rank_and_world, 1, backend="gloo", master_port=port,
                                    nnodes=2, node_rank=node_rank, timeout=120)

    threads = [threading.Thread(target=node, args=(n,)) for n in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert results == {0: [(0, 2, 0)], 1: [(1, 2, 0)]}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: launch(_explicit_none, 0), ValueError, "nprocs must be >= 1, got 0"),
        (lambda: launch(_explicit_none, "2"), TypeError, "nprocs must be an int"),
        (lambda: launch(_explicit_none, 1, nnodes=2), ValueError, "needs an explicit master_port"),
        (lambda: launch(_explicit_none, 1, nnodes=2, node_rank=2, master_port=29500), ValueError,
         "node_rank must be < nnodes=2, got 2"),
        (lambda: launch(_explicit_none, 1, master_port=70000), ValueError, "master_port must be <= 65535"),
        (lambda: launch(_explicit_none, 1, timeout=-1), ValueError, "timeout must be positive"),
        (lambda: launch(lambda: 1, 1), TypeError, "define fn at module level"),
        (lambda: launch(_explicit_none, 1, args=(threading.Lock(),)), TypeError, "picklable arguments"),
        (lambda: launch(3, 1), TypeError, "fn must be callable"),
        (lambda: launch(_explicit_none, 1, backend=""), TypeError, "backend must be a string"),
        (lambda: launch(_explicit_none, 1, start_method="fork"), ValueError,
         r"start_method must be one of \['forkserver', 'spawn'\] on this platform.*got 'fork'"),
    ],
)
def test_bad_arguments_fail_before_spawning(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_started_either_way_see_the_launching_processs_environment_at_the_launch(start_method, monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    if start_method == "forkserver":  # the server starts with today's environment (spawned workers keep nothing)
        assert launch(_environment_variable, 2, args=("DISTOPT_TEST_SET_AFTER_THE_SERVER",),
                      start_method=start_method) == [(None, False)] * 2
    monkeypatch.setenv("DISTOPT_TEST_SET_AFTER_THE_SERVER", start_method)
    # torch._dynamo reads this one as it is imported, which a server started before imported already.
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert launch(_environment_variable, 2, args=("DISTOPT_TEST_SET_AFTER_THE_SERVER",),
                  start_method=start_method) == [(start_method, True)] * 2


def _environment_variable(name):
    import os

    import torch._dynamo

    return os.environ.get(name), torch._dynamo.config.disable


def _random_draws():
    import random

    import numpy as np

    return {"torch": torch.rand(1).item(), "torch seed": torch.initial_seed(), "numpy": float(np.random.rand()),
            "random": random.random()}


@pytest.mark.timeout(180)
def test_workers_draw_their_own_random_numbers_on_every_rank_and_in_every_launch():
    # As spawned workers (fresh interpreters) do: unseeded initialisation, dropout masks, shuffles
    # and numpy augmentation differ between ranks, and between one launch and the next.
    draws = launch(_random_draws, 2) + launch(_random_draws, 2)
    for generator in ("torch", "torch seed", "numpy", "random"):
        values = [d[generator] for d in draws]
        assert len(set(values)) == len(values), f"{generator}: {values}"


def _start_a_child_and_raise(pid_file):
    if dist.get_rank() == 1:
        # The pid file's name on the command line tells this child from a later process given its pid.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", pid_file])
        Path(pid_file).write_text(str(child.pid))
        raise ValueError("boom after starting a child process")
    dist.barrier()
    time.sleep(600)


def _still_running(pid, marker):
    """The process ``pid`` if it is alive and has ``marker`` on its command line, else None."""
    try:
        process = psutil.Process(pid)
        if process.status() != psutil.STATUS_ZOMBIE and marker in process.cmdline():  # a zombie: init reaps it
            return process
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        pass
    return None


def _shut_down_while_an_error_is_handled():
    model = torch.nn.Linear(2, 1)
    opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step():
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()

    step()
    if dist.get_rank() == 1:
        try:
            raise ValueError("a bad batch")
        except ValueError:
            distopt.shutdown()  # a script's error handler, before its sys.exit(1)
        return None
    try:
        step()
    except RuntimeError as exc:
        return str(exc)
    return "rank 0 stepped alone"


@pytest.mark.timeout(180)
def test_a_rank_that_shuts_down_while_handling_an_error_is_named_as_crashed_not_as_finished():
    told = launch(_shut_down_while_an_error_is_handled, 2, timeout=120)[0]
    assert "rank 1 is gone: it crashed (ValueError: a bad batch)" in told, told
    assert "same number of batches" not in told, told


@pytest.mark.timeout(180)
def test_a_failed_workers_own_child_processes_end_with_the_launch(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 .*raised ValueError"):
        launch(_start_a_child_and_raise, 2, args=(str(pid_file),), timeout=120)
    child = int(pid_file.read_text())
    # The child was orphaned when the worker exited, out of this process's tree, where the fixture looks.
    survivor = _still_running(child, str(pid_file))
    if survivor is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            survivor.kill()
    assert survivor is None, f"the failed worker's child process {child} outlived the launch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs CUDA and NCCL.*use backend='gloo'"):
        launch(_explicit_none, 1, backend="nccl")


@pytest.fixture
def torchrun_env(monkeypatch):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env
    distopt.shutdown()


def test_under_torchrun_env_runs_fn_once_in_process(torchrun_env):
    assert launch(_rank_and_world, backend="gloo") == [(0, 1, 0)]
    assert dist.is_initialized()  # kept for later calls
    with pytest.warns(UserWarning, match="nprocs is ignored"):
        assert launch(_rank_and_world, 4, backend="gloo") == [(0, 1, 0)]


def test_init_is_idempotent_and_shutdown_tears_down(torchrun_env):
    distopt.init(backend="gloo", timeout=120)
    distopt.init()  # a second call is a no-op
    assert dist.is_initialized() and dist.get_world_size() == 1
    with pytest.warns(UserWarning, match="already initialized"):
        distopt.init(backend="mpi")
    assert launch(_rank_and_world) == [(0, 1, 0)]  # an existing group is used, and kept
    assert dist.is_initialized()
    distopt.shutdown()
    assert not dist.is_initialized()
    distopt.shutdown()  # a no-op without a group


def test_init_without_env_names_the_missing_variables(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not set.*torchrun"):
        distopt.init()
    with pytest.raises(ValueError, match="timeout must be positive"):
        distopt.init(timeout=0)


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    """torchrun_launch.py under torchrun on 2 ranks: ``(exit code, output, its directory)``."""
    out_dir = tmp_path_factory.mktemp("torchrun")
    code, out = run_torchrun(ROOT / "tests" / "_scripts" / "torchrun_launch.py", [str(out_dir)], out_dir, 120)
    return code, out, out_dir


@pytest.mark.timeout(150)
def test_init_after_shutdown_under_torchrun_meets_the_new_addresses(torchrun_job):
    code, out, _ = torchrun_job
    assert code == 0, out
    assert [line for line in out.splitlines() if line.startswith("setup")] == \
        ["setup 0: sum 3", "setup 1: sum 5", "setup 2: sum 7"], out


@pytest.mark.timeout(150)
def test_same_script_under_torchrun(torchrun_job):
    code, out, out_dir = torchrun_job
    assert code == 0, out
    for rank in range(2):
        out = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert out["launch"] == [{"rank": rank, "world_size": 2, "local_rank": rank, "sum": 30.0,
                                  "helper_rank": rank}]
        assert out["decorated"] == [2]
        assert out["initialized_after"] is True


# --- results travel by value: tensors, nested containers, whatever a worker returns ---


def _draw_tensors(seed, rank):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    count = int(torch.randint(1, 7, (1,), generator=g))
    shapes = [torch.randint(0, 40, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
              for _ in range(count)]
    return [torch.randn(shape, generator=g) for shape in shapes]  # [] is a 0-dim tensor


def _tensor_results(seed):
    tensors = _draw_tensors(seed, dist.get_rank())
    return {"rank": dist.get_rank(), "tensors": tensors, "nested": [(t.sum(), {"t": t.to(torch.int16)}) for t in tensors]}


def _expected_tensor_results(seed, world):
    return [_draw_tensors(seed, rank) for rank in range(world)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_results_arrive_intact_every_time(world):
    launches = 6 if world == 2 else 4  # each a fresh launch: a torn result showed up within a handful
    for seed in range(launches):
        results = launch(_tensor_results, world, args=(seed,), master_port=0, timeout=60)
        for rank, (result, expected) in enumerate(zip(results, _expected_tensor_results(seed, world))):
            assert result["rank"] == rank
            assert len(result["tensors"]) == len(expected)
            for got, want, (total, inner) in zip(result["tensors"], expected, result["nested"]):
                assert torch.equal(got, want)
                assert torch.equal(total, want.sum()) and torch.equal(inner["t"], want.to(torch.int16))


def _unpicklable_result():
    return lambda: None


def test_a_result_that_cannot_be_pickled_names_the_rank_and_the_type():
    with pytest.raises(WorkerFailedError, match=r"rank [01]: fn returned a function, which cannot be pickled"):
        launch(_unpicklable_result, 2, timeout=60)


# ---------------------------------------------------------------------- timeouts that hold


def _never_called():
    raise AssertionError("no worker should start")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("addr, error, match", [
    ("no.such.host", ValueError, r"master_addr='no.such.host' does not resolve"),
    ("192.0.2.1", ValueError, r"master_addr='192.0.2.1' is not an address of this machine"),
])
def test_a_bad_master_addr_fails_within_the_launch_timeout_naming_it(addr, error, match):
    start = time.monotonic()
    with pytest.raises(error, match=match):
        launch(_never_called, 2, master_addr=addr, timeout=10)
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_a_node_that_cannot_reach_the_store_fails_within_the_launch_timeout(launches_that_wait):
    outcome, seconds = launches_that_wait["unreachable store"]  # launched with timeout=15
    port = launches_that_wait["port"]
    with pytest.raises(WorkerFailedError, match=rf"could not reach the rendezvous store at 127.0.0.1:{port} within"):
        outcome.result()
    assert seconds < 15 + 4  # the worker gives up before the launch's timeout, then is reaped


def _wait_for_an_absent_rank(flag):
    """Rank 1 stays away until rank 0 has seen both collectives fail (or 60 s); rank 0 runs its own
    all-reduce, then a wrapper's round, and reports how each failed and after how long."""
    import os
    import torch.nn as nn

    outcomes = []
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return outcomes
    for what in ("all_reduce", "optimizer"):
        start = time.monotonic()
        try:
            if what == "all_reduce":
                dist.all_reduce(torch.ones(3))
            else:
                model = nn.Linear(3, 1)
                distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        except Exception as exc:
            outcomes.append((what, type(exc).__name__, str(exc), time.monotonic() - start))
    open(flag, "w").close()
    return outcomes


@pytest.mark.timeout(60)
def test_the_collective_timeout_reaches_the_process_group_and_the_wrappers_group(launches_that_wait):
    outcomes, _ = launches_that_wait["absent rank"][0].result()  # launched with collective_timeout=1.5
    (_, kind, text, elapsed), (_, wrapper_kind, wrapper_text, wrapper_elapsed) = outcomes
    assert kind in ("RuntimeError", "DistBackendError") and re.search("[Tt]imed out", text), outcomes
    # The 1.5 s timeout, plus generous room for a loaded machine (alone: 1.5 s and ~3 s).
    assert 1.5 <= elapsed < 1.5 + 8
    # the wrapper's private group inherits the timeout, and its error says what was awaited
    assert wrapper_kind == "StallError", outcomes
    assert "rank 0 waited more than 1.5 s for the other ranks to build their DistributedOptimizer" in wrapper_text
    assert 1.5 <= wrapper_elapsed < 1.5 + 10
