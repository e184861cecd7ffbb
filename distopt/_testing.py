"""Test helpers: run a function in a real multi-process world, and check for leftover processes.

Used by distopt's own tests; not part of the public API.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .launching import launch

__all__ = ["run_world", "run_torchrun", "run_command", "kill_tree", "live_children", "assert_no_children"]


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              backend: str = "gloo", **kwargs: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks with a process group.

    Even ``world_size == 1`` spawns one process with a real process group, so
    tests cover a world of one through the same code path.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks, at least 1.
        *args: positional arguments for ``fn``.
        timeout: seconds before every worker is killed and the call fails.
        backend: process-group backend, gloo by default (runs on any machine).
        **kwargs: keyword arguments for ``fn`` (``timeout`` and ``backend`` are taken by ``run_world``).

    Returns:
        ``fn``'s return values, by rank.

    Raises:
        distopt.WorkerFailedError: a rank raised (its traceback is in the message),
            exited non-zero or was killed.
        distopt.LaunchTimeoutError: the ranks did not finish within ``timeout``.
    """
    return launch(fn, world_size, args=args, kwargs=kwargs, backend=backend,
                  master_addr="127.0.0.1", master_port=0, timeout=timeout)


def run_torchrun(script: Union[str, Path], args: Sequence[str], cwd: Union[str, Path], timeout: float,
                 nprocs: int = 2) -> Tuple[Optional[int], str]:
    """Run ``script`` under ``torchrun --standalone`` with ``nprocs`` processes, importing this checkout.

    The whole process tree is killed if it runs past ``timeout``, workers included: torchrun
    starts each in a session of its own, beyond the reach of its process group.

    Returns:
        ``(exit code, output)``; the exit code is None when it timed out.
    """
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
           str(script), *args]
    code, out, _ = run_command(cmd, cwd, env, timeout, merge_stderr=True)
    return code, out


def run_command(cmd: Sequence[Union[str, Path]], cwd: Union[str, Path, None], env: Optional[Dict[str, str]],
                timeout: float, merge_stderr: bool = False) -> Tuple[Optional[int], str, str]:
    """Run ``cmd``; past ``timeout`` kill it and every process under it (torchrun's workers too).

    Returns:
        ``(exit code, stdout, stderr)``; the exit code is None when it timed out.
    """
    proc = subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process we could not see still holds the pipe
            out, err = "", ""
        return None, out or "", err or ""
    return proc.returncode, out, err or ""


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant (found before any is killed)."""
    import psutil  # a test dependency only

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(descendants, timeout=5)


def _is_multiprocessing_helper(child: Any) -> bool:
    """multiprocessing's resource tracker or fork server: each starts once per launching process and
    stops at its exit; neither is a worker. The fork server's own children, the workers, carry its
    command line too, so only a direct child of this process counts as the server."""
    cmdline = child.cmdline()
    if any("multiprocessing.resource_tracker" in part for part in cmdline):
        return True
    return child.ppid() == os.getpid() and any("multiprocessing.forkserver" in part for part in cmdline)


def live_children(ignore: Iterable[int] = ()) -> List[Any]:
    """Child processes of this process still alive (zombies included), minus multiprocessing's helpers.

    Args:
        ignore: pids to leave out (children that existed before the code under test ran).

    Returns:
        ``psutil.Process`` objects.
    """
    import psutil  # a test dependency only

    skip = set(ignore)
    found = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        if child.pid in skip:
            continue
        try:
            if not _is_multiprocessing_helper(child):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            if child.is_running():  # a zombie: it exited but was never reaped
                found.append(child)
        except psutil.AccessDenied:
            found.append(child)
    return found


def assert_no_children(ignore: Iterable[int] = ()) -> None:
    """Fail if any child process (a worker, a zombie, a grandchild) is left.

    Args:
        ignore: pids to leave out (children that existed before the code under test ran).

    Raises:
        AssertionError: naming the leftover processes.
    """
    left = live_children(ignore)
    if left:
        described = []
        for proc in left:
            try:
                described.append(f"pid {proc.pid} ({proc.status()}): {' '.join(proc.cmdline())[:200]}")
            except Exception:  # it may vanish while we look
                described.append(f"pid {proc.pid}")
        raise AssertionError("processes left behind:\n" + "\n".join(described))
