"""The inspector's bookkeeping from the threads that touch it: the main thread, its own, and finalizers.

A wrapper the garbage collector frees closes itself from its finalizer, which runs on whichever
thread allocated when the collection started: also inside the inspector's own critical sections.
"""
import gc
import json
import threading

from distopt.transport import stalls
from distopt.transport.stalls import Progress


class Store:
    def __init__(self):
        self.values = {}

    def clone(self):
        return self

    def set(self, key, value):
        self.values[key] = value

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


class Closes:
    """Stands for a wrapper in a reference cycle: only the collector frees it, and it retires then."""

    def __init__(self, progress):
        self.progress, self.cycle = progress, self

    def __del__(self):
        stalls.retire(self.progress)


def test_a_wrapper_freed_by_a_collection_inside_the_inspectors_lock_retires_without_waiting_for_it(monkeypatch):
    inspector = stalls._Inspector(Store())
    monkeypatch.setattr(stalls, "_inspector", inspector)
    progress = Progress(group="g", ranks=[0, 1], rank=0, warn_after=None, raise_after=None)
    stalls.watch(progress)
    finished = threading.Event()

    def collect_holding_the_lock():
        # What live() does when its allocation starts a collection that frees a wrapper.
        with inspector.lock:
            gc.collect()
        finished.set()

    gc.disable()
    try:
        Closes(progress)
        worker = threading.Thread(target=collect_holding_the_lock, daemon=True)
        worker.start()
        worker.join(timeout=10)
    finally:
        gc.enable()
        stalls.stop()
    assert finished.is_set(), "the finalizer's retire() waited for the lock its own thread holds"
    assert progress not in inspector.live()
    assert json.loads(inspector.store.values["distopt/progress/g/0"])["closed"] is True
    assert list(inspector.retired) == [progress]
