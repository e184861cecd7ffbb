"""Start data-parallel workers that fail fast, or run unchanged under torchrun.

:func:`launch` (and its decorator form :func:`launcher`) runs a function in
spawned worker processes with a ``torch.distributed`` process group, or once in
place under ``torchrun``; :func:`init` and :func:`shutdown` set up and tear down
the process group of a script that ``torchrun`` started.

The only environment variables read or written are torchrun's ``env://``
contract: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (and ``GROUP_RANK``, read for the default
islands of :class:`distopt.Islands`). Beyond them, a worker takes the launching
process's environment whole, and the fork server is started again when that
environment changed; neither acts on any variable's value.

Modules, each depending only on those listed before it:

- :mod:`.errors`: what :func:`launch` raises when a worker fails or the job times out.
- :mod:`.process_group`: :func:`init`, :func:`shutdown` and the backend defaults.
- :mod:`.worker`: a spawned worker, from process start to its report.
- :mod:`.fork_server`: the fork server the workers start from, kept in step with the environment.
- :mod:`.supervisor`: the launching process starting, watching and stopping the workers.
- :mod:`.api`: :func:`launch` and :func:`launcher`, with their argument checks.
- :mod:`.placement`: the host and local rank torchrun or :func:`launch` gave this process.

This is a package rather than a ``distopt/launcher.py`` module because
``distopt.launcher`` is the decorator, which would shadow a module of that name.
"""
from .api import DEFAULT_TIMEOUT, launch, launcher
from .errors import LaunchError, LaunchTimeoutError, WorkerFailedError
from .lifecycle import init, shutdown

__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchError",
    "WorkerFailedError",
    "LaunchTimeoutError",
    "launch",
    "launcher",
    "init",
    "shutdown",
]
