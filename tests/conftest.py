"""Shared fixtures for distopt's tests, and the order in which xdist hands out the test files."""
import os

import pytest
import torch

from distopt._testing import assert_no_children, live_children

# xdist (setup.cfg: --dist loadfile --no-loadscope-reorder) hands out whole files in collection
# order. The slowest files go first, longest first, so that none starts near the end while the
# other worker runs out of files (xdist's own order, by number of tests, started two of the
# slowest files last). Seconds under the full suite on a 2-core host, as a guide when adding to this list:
SLOWEST_FIRST = [  # seconds per file, summed over its tests, in one idle run of the whole suite
    # ("est.": that idle run's seconds scaled by runs of the file before and after its jobs went side by side)
    "launching/test_launcher.py",  # ~74, before its timeout waits went side by side, its torchrun checks one job
    "multiprocess/test_peer_gone.py",  # ~53 est. (one thread per process; 5 torchrun jobs, then 4 jobs by hand)
    "fault_tolerance/test_launch.py",  # ~38: the kill across two namespaced hosts, the example on one
    "fronts/test_benchmark.py",  # ~38 est., nearly all of it CPU, its three runs in one process
    "horovod/test_horovod.py",  # ~35 est.: four torchrun jobs side by side, one world
    "fronts/test_examples.py",  # ~34 est.: six runs, three at a time, then the killed one
    "fault_tolerance/test_fault_tolerance_modes.py",  # ~34
    "launching/test_two_hosts.py",  # ~31
    "fault_tolerance/test_fault_tolerance.py",  # ~21
    "multiprocess/test_agreement.py",  # ~17 est.: its two worlds side by side
    "multiprocess/test_stalls.py",  # ~16 est.: its four worlds side by side
    "fronts/test_lightning.py",  # ~16: one launch of Lightning's, short fits
    "fault_tolerance/test_fault_tolerance_settings.py",  # ~16
    "multiprocess/test_sharded.py",  # ~14
    "multiprocess/test_compression.py",  # ~11
    "launching/test_clean_exit.py",  # ~11
    "multiprocess/test_join.py",  # ~10
    "multiprocess/test_optimizer_dist.py",  # ~10
    "fronts/test_benchmark_link.py",  # ~9
    "multiprocess/test_sparse_rows.py",  # ~8
]


def pytest_configure(config):
    # Two xdist workers share the CI's two cores, and each starts ranks of its own. torch's default
    # of one intra-op thread per core oversubscribes them, and OpenMP's spinning threads then
    # take turns at a core: a test ran 4x slower under the suite than alone. One thread each,
    # in this process and in every process it starts (they inherit the environment).
    os.environ["OMP_NUM_THREADS"] = "1"
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
