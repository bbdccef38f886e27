"""Background warm-up of a worker process (:func:`warm_in_background`)."""

from __future__ import annotations

import gc
import threading

from resilient_rl.runtime import worker


def test_warm_up_threads_are_waited_for_and_finished_ones_are_dropped(monkeypatch):
    monkeypatch.setattr(worker, "_WARMING", [])
    release = threading.Event()
    worker.warm_in_background(release.wait, "slow-import")
    for i in range(20):  # a process that takes over rank after rank warms up each time
        worker.warm_in_background(lambda: None, f"quick-{i}")
        worker._WARMING[-1].join(timeout=10)
    assert [t.name for t in worker._WARMING] == ["slow-import", "quick-19"]
    release.set()
    for thread in list(worker._WARMING):
        thread.join(timeout=10)
    worker.warm_in_background(lambda: None, "last")
    assert [t.name for t in worker._WARMING] == ["last"]


def test_the_warm_up_runs_with_the_garbage_collector_off_and_says_so(monkeypatch):
    monkeypatch.setattr(worker, "_WARMING", [])
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def imports():
        seen["gc"] = gc.isenabled()
        inside.set()
        release.wait(10)

    assert gc.isenabled()
    worker.warm_in_background(imports, "warm-test")
    assert inside.wait(10)
    assert worker.warming() and seen["gc"] is False
    release.set()
    for t in list(worker._WARMING):
        t.join(10)
    assert not worker.warming() and gc.isenabled()
