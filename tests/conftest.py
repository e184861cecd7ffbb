"""Shared fixtures for distopt's tests."""
import pytest

from distopt._testing import assert_no_children, live_children


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves any child process (worker, zombie or grandchild) behind."""
    before = [proc.pid for proc in live_children()]  # an earlier test's leak is not this test's
    yield
    assert_no_children(ignore=before)
