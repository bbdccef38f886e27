"""Leave nothing in node memory that no run will use, and keep what a run's next controller will.

Two kinds of files outlive a process that is killed:

- a run's snapshot directory (``<root>/resilient-rl-<run>-<controller>``,
  :mod:`resilient_rl.workers.snapshots.node_memory`), left when its controller is gone before it
  removes it: killed, or preempted with no warning, which leaves it on purpose for the run's next
  controller (:mod:`resilient_rl.workers.snapshots.carry`). Its ``.owner`` file (JSON, written
  when the directory is created) names the controller's process (host, boot, pid namespace, pid
  and start time) and how long the directory is to be kept once that process is gone
  (``keep_s``: ``recovery.snapshot_hand_over_s``);
- a shared-memory reduction segment and its pipes (``/dev/shm/rrl-reduce-<pid>-...``,
  :mod:`resilient_rl.workers.shm_reduce`), left when the rank that created it dies in set-up;
  its name carries the creating pid.

:func:`sweep_node` removes, whatever the run:

- a run directory whose owner is gone (the owner ran on this host, same boot and pid namespace,
  and no process with its pid and start time exists): at once where it holds no committed
  snapshot; where it does, once it has not changed for the owner's ``keep_s`` and no process
  holds its ``.alive`` lock: until then a requeue of its run on this node adopts it;
- one whose owner cannot be checked from here (a controller on another node, or no ``.owner``):
  once no process holds its ``.alive`` lock and it has not changed for :data:`STALE_S` (or the
  owner's ``keep_s`` where longer);
- every reduction segment whose creator is gone.

A live run that needs the room takes it first (``reclaim``: :func:`sweep_runs`; a ring that would
leave its node short, :mod:`resilient_rl.workers.snapshots.node_memory`): a kept directory whose
owner is gone, and one whose owner cannot be checked that has not been marked in use for
:data:`MARK_LOST_S`. The controller sweeps every node when it starts and every
:data:`SWEEP_EVERY_S` of its run (:class:`NodeSweeps`), each sweep marking its own directory in use
(:func:`mark_in_use`); the first process that opens a run directory on a node sweeps that node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from typing import Any, Callable, Iterator

import psutil

from resilient_rl.runtime.cluster import on_every_node

logger = logging.getLogger(__name__)

OWNER_FILE = ".owner"
#: Prefix of a run's directory under the root.
PREFIX = "resilient-rl-"
#: Age (seconds since its last change) past which an unused run directory whose owner cannot be
#: checked is removed; also how long one whose owner is gone is kept where its ``.owner`` names no
#: ``keep_s``.
STALE_S = 600.0
#: Seconds between a controller's sweeps of every node during its run.
SWEEP_EVERY_S = 60.0
#: A directory whose owner cannot be checked, not marked in use for this long: its controller is
#: gone (it marks it every :data:`SWEEP_EVERY_S`), and a run that needs the room takes it.
MARK_LOST_S = 3 * SWEEP_EVERY_S
REDUCE_PREFIX = "rrl-reduce-"
_REDUCE_NAME = re.compile(rf"^{REDUCE_PREFIX}(\d+)-")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_record(pid: int | None = None, keep_s: float = STALE_S) -> dict[str, Any]:
    """Who owns what this process leaves in node memory: enough to tell, on the same host, whether
    that process still runs (a pid alone may be reused); and ``keep_s``, how long to keep it for
    the run's next controller once that process is gone."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot": _boot_id(), "pidns": _pid_namespace(), "pid": pid,
            "start": psutil.Process(pid).create_time(), "keep_s": float(keep_s)}


def owner_alive(record: dict) -> bool | None:
    """Whether the owner process of ``record`` runs; None where this host cannot tell (another
    host, boot or pid namespace)."""
    try:
        if (record["host"], record["boot"], record["pidns"]) != (socket.gethostname(), _boot_id(), _pid_namespace()):
            return None
        proc = psutil.Process(int(record["pid"]))
        return abs(proc.create_time() - float(record["start"])) < 1.0
    except psutil.NoSuchProcess:
        return False
    except (KeyError, TypeError, ValueError, psutil.Error):
        return None


def write_owner(run_dir: str, record: dict) -> None:
    """Write ``record`` as ``run_dir``'s ``.owner`` (0600) unless one is there."""
    path = os.path.join(run_dir, OWNER_FILE)
    if os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_owner(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, OWNER_FILE)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _other_runs(root: str, keep: str | None) -> list[str]:
    """The run directories under ``root`` other than ``keep`` (none when ``root`` cannot be listed)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if os.path.join(root, n) != keep]


def _age(run: str, now: float) -> float | None:
    """Seconds since ``run`` or one of its node directories last changed (a snapshot committed, a
    sweep of its controller marking it in use); None when it cannot be read."""
    try:
        times = [os.stat(run).st_mtime] + [os.stat(os.path.join(run, n)).st_mtime for n in os.listdir(run)]
    except OSError:
        return None
    return now - max(times)


def holds_snapshot(run: str) -> bool:
    """Whether ``run`` holds a committed snapshot copy on some node (a slot's ``.meta``): what a
    next controller of its run could adopt."""
    try:
        parts = [os.path.join(run, n) for n in os.listdir(run)]
        return any(n.endswith(".meta") for p in parts if os.path.isdir(p) for n in os.listdir(p))
    except OSError:
        return False


def keep_for(record: dict | None) -> float:
    """How long the owner of ``record`` asked its run directory to be kept once it is gone
    (``recovery.snapshot_hand_over_s``; :data:`STALE_S` where the record names none)."""
    try:
        return max(float(record["keep_s"]), 0.0)  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return STALE_S


def _verdict(run: str, now: float, reclaim: bool) -> str | None:
    """Whether a sweep removes ``run``: ``"gone"`` (at once), ``"unused"`` (where no process
    holds its ``.alive`` lock) or None (kept); ``reclaim``: a live run needs the room."""
    record = read_owner(run)
    alive = owner_alive(record) if record is not None else None
    if alive:
        return None
    age = _age(run, now)
    if age is None:
        return None
    if alive is False:  # its controller is gone: kept for the run's next one only with something to adopt
        if not holds_snapshot(run):
            return "gone"
        return "unused" if reclaim or age > keep_for(record) else None
    # Its owner cannot be checked from here: a live controller's sweeps mark it in use every SWEEP_EVERY_S.
    return "unused" if age > (MARK_LOST_S if reclaim else max(STALE_S, keep_for(record))) else None


@contextlib.contextmanager
def _unused(run: str) -> Iterator[bool]:
    """Whether no process holds the ``.alive`` lock of one of ``run``'s node directories; while
    the block runs, none can take it (this process holds them all exclusively)."""
    fds = []
    try:
        for n in os.listdir(run):
            alive = os.path.join(run, n, ".alive")
            if os.path.exists(alive):
                fd = os.open(alive, os.O_RDWR)
                fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: in use
        free = True
    except OSError:
        free = False
    try:
        yield free
    finally:
        for fd in fds:
            os.close(fd)


def _remove_unless_in_use(run: str) -> bool:
    """Remove ``run`` unless a process holds the ``.alive`` lock of one of its node directories."""
    with _unused(run) as free:
        if free:
            shutil.rmtree(run, ignore_errors=True)
        return free


def _size(run: str) -> int:
    total = 0
    for parent, _, files in os.walk(run):
        for f in files:
            try:
                total += os.lstat(os.path.join(parent, f)).st_blocks * 512
            except OSError:
                pass
    return total


def sweep_runs(root: str, keep: str | None = None, reclaim: bool = False, now: float | None = None) -> list[str]:
    """Remove the run directories under ``root`` (other than ``keep``) that no run will use (see
    the module's text); with ``reclaim`` (a live run needs the room) also those kept for a next
    controller. Returns those removed."""
    now = time.time() if now is None else now
    removed = []
    for run in _other_runs(root, keep):
        verdict = _verdict(run, now, reclaim)
        if verdict == "gone":
            shutil.rmtree(run, ignore_errors=True)
        if verdict == "gone" or (verdict == "unused" and _remove_unless_in_use(run)):
            removed.append(run)
    if removed:
        logger.info("removed snapshot memory under %s left by controllers that are gone%s: %s", root,
                    " (the room is needed)" if reclaim else "", removed)
    return removed


def reclaimable_bytes(root: str, now: float | None = None) -> int:
    """Bytes under ``root`` that :func:`sweep_runs` with ``reclaim`` would free now."""
    now = time.time() if now is None else now
    total = 0
    for run in _other_runs(root, None):
        verdict = _verdict(run, now, reclaim=True)
        if verdict == "unused":
            with _unused(run) as free:
                verdict = "unused" if free else None
        total += _size(run) if verdict is not None else 0
    return total


def mark_in_use(run: str | None) -> None:
    """Mark ``run`` (this controller's directory, where this node has one) in use now: its age
    restarts, so a node that cannot check its owner keeps it while the controller lives, and once
    it is gone the keep counts from here."""
    if run:
        try:
            os.utime(run)
        except OSError:
            pass


def sweep_reduce_segments(shm_dir: str) -> list[str]:
    """Remove the ``rrl-reduce-<pid>-*`` files in ``shm_dir`` whose creating process is gone (no
    process with that pid, or one started after the file was made: the pid was reused)."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _REDUCE_NAME.match(name)
        if m is None:
            continue
        path = os.path.join(shm_dir, name)
        try:
            made = os.lstat(path).st_mtime
            try:
                alive = psutil.Process(int(m.group(1))).create_time() <= made + 1.0
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def sweep_node(root: str, keep: str | None, shm_dir: str) -> list[str]:
    """On this node: mark ``keep`` in use (:func:`mark_in_use`), then :func:`sweep_runs` of
    ``root`` and :func:`sweep_reduce_segments` of ``shm_dir``."""
    mark_in_use(keep)
    segments = sweep_reduce_segments(shm_dir)
    if segments:
        logger.info("removed reduction segments whose creator is gone: %s", segments)
    return (sweep_runs(root, keep) if root else []) + segments


def sweep_every_node(root: str, keep: str | None, shm_dir: str, wait_s: float | None = None) -> None:
    """Run :func:`sweep_node` on every live Ray node (:func:`~resilient_rl.runtime.cluster.on_every_node`:
    here for this node, as tasks needing no CPU elsewhere). The tasks are not waited for unless
    ``wait_s`` (a start is not delayed by a task's process starting); a node that cannot be
    reached is skipped (logged)."""
    try:
        on_every_node(sweep_node, root, keep, shm_dir, wait_s=wait_s)
    except Exception as exc:  # a node that went away meanwhile: its memory went with it
        logger.warning("sweeping node memory under %s and %s: %s", root, shm_dir, exc)


class NodeSweeps:
    """A controller's sweeps of every node (:func:`sweep_every_node`, keeping its own directory
    ``keep``): one at its start (:meth:`now`), then one every ``every_s`` of its run
    (:meth:`maybe`, between steps), so that memory kept for a gone controller's next one is freed
    once its keep ends, and this controller's own is marked in use."""

    def __init__(self, root: str, keep: str | None, shm_dir: str, every_s: float = SWEEP_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, sweep: Callable[..., None] = sweep_every_node):
        self.root, self.keep, self.shm_dir, self.every_s = root, keep, shm_dir, every_s
        self.clock, self._sweep = clock, sweep
        self.last: float | None = None

    def now(self) -> None:
        self._sweep(self.root, self.keep, self.shm_dir)
        self.last = self.clock()

    def maybe(self) -> None:
        """Sweep where the last sweep is ``every_s`` old (none before :meth:`now`)."""
        if self.last is not None and self.clock() - self.last >= self.every_s:
            self.now()
