"""Shared fixtures for distopt's tests, and the order in which xdist hands out the test files."""
import os

import pytest
import torch

from distopt._testing import assert_no_children, live_children

# xdist (setup.cfg: --dist loadfile --no-loadscope-reorder) hands out whole files in collection
# order. The slowest files go first, longest first, so that none starts near the end while the
# other worker runs out of files (xdist's own order, by number of tests, started two of the
# slowest files last). Seconds under the full suite on a 2-core host, as a guide when adding to this list:
SLOWEST_FIRST = [  # seconds per file, summed over its tests, in one run of the whole suite (2 workers, idle machine)
    "launching/test_launcher.py",  # ~95
    "fault_tolerance/test_launch.py",  # ~63
    "fronts/test_benchmark.py",  # ~61
    "multiprocess/test_peer_gone.py",  # ~56
    "multiprocess/test_sharded_casts.py",  # ~49 (alone, -n 0)
    "fronts/test_examples.py",  # ~35
    "fault_tolerance/test_fault_tolerance_modes.py",  # ~33
    "fault_tolerance/test_fault_tolerance.py",  # ~30
    "launching/test_two_hosts.py",  # ~29
    "horovod/test_horovod.py",  # ~28
    "fronts/test_benchmark_islands.py",  # ~20
    "fault_tolerance/test_fault_tolerance_settings.py",  # ~19
    "multiprocess/test_sharded.py",  # ~19
    "multiprocess/test_agreement.py",  # ~18
    "launching/test_clean_exit.py",  # ~15
    "multiprocess/test_islands.py",  # ~15
    "multiprocess/test_islands_sharded_gradients.py",  # ~15
    "multiprocess/test_compression.py",  # ~12
    "fronts/test_lightning.py",  # ~12
    "multiprocess/test_join.py",  # ~10
    "multiprocess/test_sparse_rows.py",  # ~9
    "multiprocess/test_stalls.py",  # ~9
    "multiprocess/test_optimizer_dist.py",  # ~9
    "fronts/test_benchmark_link.py",  # ~8
]


def pytest_configure(config):
    # Two xdist workers share the CI's two cores, and each starts ranks of its own. torch's default
    # of one intra-op thread per core oversubscribes them, and OpenMP's spinning threads then
    # take turns at a core: a test ran 4x slower under the suite than alone. One thread each,
    # in this process and in every process it starts (they inherit the environment).
    os.environ["OMP_NUM_THREADS"] = "1"
    # A process may still give itself more threads (a launched rank alone on its host, the
    # benchmark's world-size-1 section: cores // local processes). OpenMP's threads then spin
    # between parallel regions, burning the core the other worker's ranks wait for: the benchmark's
    # world-size-1 run took 20-32 s beside a busy neighbour, 8-11 s with its threads sleeping
    # instead. The OpenMP runtime reads this when torch loads, in every process started from here.
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, name in enumerate(SLOWEST_FIRST) if path.endswith(name)), len(SLOWEST_FIRST))

    items.sort(key=rank)  # stable: the other files keep their order, and every file its tests' order


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves any child process (worker, zombie or grandchild) behind."""
    before = [proc.pid for proc in live_children()]  # an earlier test's leak is not this test's
    yield
    assert_no_children(ignore=before)
