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


def room_report(directory: str, nbytes: int) -> str:
    """Where the room of the tmpfs holding run directory ``directory`` went, for an error that
    ``nbytes`` more did not fit: its free and total bytes, the bytes of files in this run's
    directory and in the others beside it, and the rest in use: files already removed that a
    process still holds (their pages stay until it lets go, named where found) or whose pages the
    kernel is still freeing."""
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    root = os.path.dirname(directory)
    try:
        st = os.statvfs(root)
    except OSError as exc:
        return f"reserving {mib(nbytes)} in {directory}: the file system cannot be read ({exc})"
    total, used = st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize
    ours = others = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                held = os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
            if dirpath == directory or dirpath.startswith(directory + os.sep):
                ours += held
            else:
                others += held
    rest = max(used - ours - others, 0)
    # Where the root is the file system (a tmpfs such as /dev/shm), what no file holds is held by
    # removed files still open or mapped; a folder of a larger file system shares it with everything else.
    if os.path.ismount(root):
        held = removed_file_holders(root)
        rest = f"{mib(rest)} is held by removed files (still open or mapped, or being freed)" + (
            f" ({', '.join(f'pid {pid} {name}: {mib(n)}' for pid, name, n in held)})" if held else "")
    else:
        rest = f"{mib(rest)} is used by the rest of that file system"
    return (f"reserving {mib(nbytes)} in {directory}: {mib(st.f_bavail * st.f_frsize)} free of {mib(total)}; "
            f"this run's files hold {mib(ours)}, other files there {mib(others)}, and {rest}")


def removed_file_holders(root: str, proc: str = "/proc") -> list[tuple[int, str, int]]:
    """(pid, process name, bytes) of every process that holds files under ``root`` that were
    removed (open or mapped: their pages stay in use until it lets go), most bytes first. Only the
    processes this user may inspect are seen."""
    prefix = root.rstrip(os.sep) + os.sep
    out = []
    for pid in (p for p in os.listdir(proc) if p.isdigit()):
        files: dict[str, int] = {}
        try:
            with open(f"{proc}/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix) and parts[5].endswith(" (deleted)\n"):
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        files[parts[5]] = max(files.get(parts[5], 0), end - start)
            for fd in os.listdir(f"{proc}/{pid}/fd"):
                try:  # each on its own: an fd closed since the listing (the listing's own) is no answer
                    target = os.readlink(f"{proc}/{pid}/fd/{fd}")
                    if target.startswith(prefix) and target.endswith(" (deleted)"):
                        files.setdefault(target + "\n", os.stat(f"{proc}/{pid}/fd/{fd}").st_size)
                except OSError:
                    continue
            with open(f"{proc}/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if files:
            out.append((int(pid), name, sum(files.values())))
    return sorted(out, key=lambda held: -held[2])
