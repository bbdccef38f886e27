"""How many processes ``pytest -n auto`` runs the suites in (pytest-xdist)."""

from __future__ import annotations

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
