"""What a node can hold for in-memory snapshots: its tmpfs, its RAM and its cgroup's memory limit.

``recovery.snapshot_every=auto`` (:mod:`resilient_rl.workers.snapshots.sizing`) decides from
these, measured on each node by a rank running there (:meth:`RankSnapshots.snapshot_sizing`),
together with the bytes of each rank's snapshot copy. Every reader is injectable, so the sizing
logic is tested against any tmpfs size, RAM or cgroup limit.

Pages written to a tmpfs are memory: they count against the node's RAM and against the memory
cgroup of the process that wrote them (a container's limit), as well as against the tmpfs size
(Docker's default ``/dev/shm`` is 64 MB).
"""

from __future__ import annotations

import os
from typing import Callable

from resilient_rl.workers.snapshots import node_sweep

#: cgroup v2, then v1: (limit file, usage file).
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
#: A cgroup v1 "limit" at or above this is no limit (the kernel writes a huge page-aligned number).
UNLIMITED = 2**60


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mem_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def tmpfs_free(directory: str, statvfs: Callable = os.statvfs) -> tuple[int, int] | None:
    """(free bytes, size in bytes) of the filesystem holding ``directory`` (or its nearest
    existing parent: the run's directory is created later), None where there is none."""
    path = directory
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        st = statvfs(path or "/")
    except OSError:
        return None
    return int(st.f_bavail * st.f_frsize), int(st.f_blocks * st.f_frsize)


def cgroup_free(read: Callable[[str], str | None] = _read) -> int | None:
    """Bytes the memory cgroup of this process may still use (limit - usage), None when unlimited
    or unknown."""
    for limit_file, usage_file in CGROUP_FILES:
        limit = read(limit_file)
        if limit is None:
            continue
        if limit == "max":
            return None
        try:
            limit_b, usage_b = int(limit), int(read(usage_file) or 0)
        except ValueError:
            return None
        return None if limit_b >= UNLIMITED else max(limit_b - usage_b, 0)
    return None


def free_bytes(directory: str) -> int:
    """The smaller of the free bytes of the tmpfs holding ``directory`` (where there is one) and
    the RAM available: what more pages written there can take."""
    tmpfs = tmpfs_free(directory)
    mem = _mem_available()
    return mem if tmpfs is None else min(tmpfs[0], mem)


def measure(directory: str, *, statvfs: Callable = os.statvfs, read: Callable[[str], str | None] = _read,
            mem_available: Callable[[], int] = _mem_available,
            reclaimable: Callable[[str], int] = node_sweep.reclaimable_bytes) -> dict:
    """This node's room for snapshots: ``{"dir", "tmpfs_free", "tmpfs_size"}`` (None without a
    directory, or where it does not exist), ``"mem_available"``, ``"cgroup_free"`` (None:
    unlimited) and ``"reclaimable"`` (what runs whose controller is gone keep under the directory
    for their next one, which a live run that needs the room takes), in bytes."""
    tmpfs = tmpfs_free(directory, statvfs) if directory else None
    return {"dir": directory, "tmpfs_free": None if tmpfs is None else tmpfs[0],
            "tmpfs_size": None if tmpfs is None else tmpfs[1],
            "mem_available": int(mem_available()), "cgroup_free": cgroup_free(read),
            "reclaimable": reclaimable(directory) if tmpfs is not None else 0}
