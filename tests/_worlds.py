"""One launch per world size for a test file's multi-process checks.

Starting ranks costs seconds (importing torch), so a test file names its checks,
each with the world size it runs in; the first test that asks for a check runs
every check of that world size in one launch, in order, and each test then reads
its own check's per-rank values. A check that raises fails its own test only,
with the rank's traceback. A launch that fails as a whole (a check that hangs
until the launch's timeout, a rank that crashes) fails every test of that world
size: the first at once, the later ones without launching again, each with the
first failure's cause, so one hang costs one timeout rather than one per test.
"""
import traceback
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import pytest

from distopt._testing import assert_no_children, run_world

__all__ = ["Worlds", "run_checks"]


def run_checks(calls: Sequence[Tuple[Callable[..., Any], tuple, dict]]) -> List[Tuple[str, Any]]:
    """On one rank: each ``(function, args, kwargs)`` in order, as ``("ok", value)`` or ``("error", traceback)``."""
    results = []
    for fn, args, kwargs in calls:
        try:
            results.append(("ok", fn(*args, **kwargs)))
        except Exception:
            results.append(("error", traceback.format_exc()))
    return results


class Worlds:
    """The checks of one test file, run one launch per world size on first use.

    Args:
        checks: name -> ``(world size, function, args)`` or ``(world size, function, args, kwargs)``;
            functions are module-level, so that the ranks can import them.
        timeout: seconds for one launch.
    """

    def __init__(self, checks: Mapping[str, tuple], timeout: float = 240.0) -> None:
        self.checks = dict(checks)
        self.timeout = timeout
        self._done: Dict[int, Dict[str, list]] = {}
        self._failed: Dict[int, str] = {}  # world size -> why its launch failed

    def results(self, name: str, **fields: str) -> List[Any]:
        """Every rank's value of check ``name``, by rank.

        Args:
            name: the check.
            **fields: fill ``{field}`` in the string arguments of every check of this world size,
                on its first run (a temporary directory, say).
        """
        world = self.checks[name][0]
        if world in self._failed:
            pytest.fail(f"the world of {world} ranks for these checks failed earlier in this run, so "
                        f"{name!r} never ran; the first failure:\n{self._failed[world]}")
        if world not in self._done:
            names = [n for n, check in self.checks.items() if check[0] == world]
            calls = []
            for n in names:
                _, fn, args, *kwargs = self.checks[n]
                args = tuple(a.format(**fields) if fields and isinstance(a, str) else a for a in args)
                calls.append((fn, args, kwargs[0] if kwargs else {}))
            try:
                per_rank = run_world(run_checks, world, calls, timeout=self.timeout)
            except Exception as exc:  # a hang (LaunchTimeoutError) or a crashed rank
                self._failed[world] = f"{type(exc).__name__}: {exc}"
                assert_no_children()
                raise
            self._done[world] = {n: [rank[k] for rank in per_rank] for k, n in enumerate(names)}
            assert_no_children()
        outcome = self._done[world][name]
        for status, value in outcome:
            if status == "error":
                pytest.fail(f"the check raised on a rank:\n{value}")
        return [value for _, value in outcome]
