"""The shared multi-process worlds fail fast: one hang costs one timeout, not one per test."""
import time

import pytest
from _worlds import Worlds

from distopt import LaunchTimeoutError


def _hang() -> None:
    time.sleep(60)


def _answer() -> int:
    return 42


def test_a_world_that_hung_fails_every_later_test_at_once_with_the_first_cause(no_leftover_processes):
    # Short: the launch times out whether or not the rank got as far as the hang, and the launching
    # process hosts the store, so nothing else can fail first.
    worlds = Worlds({"hangs": (1, _hang, ()), "fine": (1, _answer, ())}, timeout=1.5)
    with pytest.raises(LaunchTimeoutError):
        worlds.results("hangs")
    start = time.perf_counter()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)failed earlier in this run, so 'fine' never ran.*"
                                                   r"LaunchTimeoutError"):
        worlds.results("fine")
    assert time.perf_counter() - start < 1.0  # no second launch


def test_a_check_that_raises_fails_its_own_test_only(no_leftover_processes):
    worlds = Worlds({"raises": (1, int, ("not a number",)), "fine": (1, _answer, ())})
    with pytest.raises(pytest.fail.Exception, match="invalid literal for int"):
        worlds.results("raises")
    assert worlds.results("fine") == [42]
