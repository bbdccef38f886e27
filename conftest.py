"""What both suites share: how many processes ``pytest -n auto`` runs them in (pytest-xdist),
and the check that no test leaves an error for Ray to log as unhandled."""

from __future__ import annotations

import pytest

from resilient_rl.runtime.spare_sizing import available_host_bytes, cores_here

#: What one test process may hold at once: a chaos run's controller and its six workers, or a
#: Ray cluster of a tests/ module, each about 0.5 GiB.
MEMORY_PER_PROCESS = 4 * 1024**3
#: Each process starts Ray clusters of its own; past this, more processes mostly add startup work.
MAX_PROCESSES = 4


def pytest_xdist_auto_num_workers(config):
    cpus = cores_here() or 1
    available = available_host_bytes()
    by_memory = MAX_PROCESSES if available is None else available // MEMORY_PER_PROCESS
    return max(1, min(cpus, by_memory, MAX_PROCESSES))


@pytest.fixture(autouse=True)
def no_unhandled_ray_errors(monkeypatch):
    """A failure the trainer handled leaves nothing for Ray to log as "Unhandled error" on the
    user's console: every call whose error could follow from it is read (see
    :mod:`resilient_rl.runtime.group_wait`)."""
    import ray._private.worker as ray_worker

    unhandled: list = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", unhandled.append)
    yield
    assert not unhandled, f"Ray logged {len(unhandled)} unhandled error(s); the first: {unhandled[0]}"
