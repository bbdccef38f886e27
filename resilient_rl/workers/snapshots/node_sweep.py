"""Leave nothing behind in node memory: every start removes what dead owners left there.

Two kinds of files outlive a process that is killed:

- a run's snapshot directory (``<root>/resilient-rl-<run>-<controller>``,
  :mod:`resilient_rl.workers.snapshots.node_memory`), left when its controller is killed before it removes
  it. Its ``.owner`` file (JSON, written when the directory is created) names the controller's
  process: host, boot, pid namespace, pid and start time;
- a shared-memory reduction segment and its pipes (``/dev/shm/rrl-reduce-<pid>-...``,
  :mod:`resilient_rl.workers.shm_reduce`), left when the rank that created it dies in set-up;
  its name carries the creating pid.

:func:`sweep_node` removes, whatever the run, every such directory whose owner process is gone
(the owner ran on this host, same boot and pid namespace, and no process with its pid and start
time exists), and every segment whose creator is gone. A directory whose owner cannot be checked
from here (a controller on another node, or no ``.owner``) is removed once no process holds its
``.alive`` lock and it has not changed for :data:`STALE_S`.
The controller runs it on every node when it starts (:func:`sweep_every_node`); so does the first
process that opens a run directory on a node.
"""

from __future__ import annotations

import json
import fcntl
import logging
import os
import re
import shutil
import socket
import time
from typing import Any

import psutil

from resilient_rl.runtime.cluster import on_every_node

logger = logging.getLogger(__name__)

OWNER_FILE = ".owner"
#: Prefix of a run's directory under the root.
PREFIX = "resilient-rl-"
#: Age (seconds since its last change) past which an unused run directory is removed.
STALE_S = 600.0
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


def owner_record(pid: int | None = None) -> dict[str, Any]:
    """Who owns what this process leaves in node memory: enough to tell, on the same host, whether
    that process still runs (a pid alone may be reused)."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot": _boot_id(), "pidns": _pid_namespace(), "pid": pid,
            "start": psutil.Process(pid).create_time()}


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


def sweep_runs(root: str, keep: str | None = None) -> list[str]:
    """Remove the run directories under ``root`` (other than ``keep``) whose owner on this host is
    gone; the others are left to the age rule (:func:`sweep_stale`)."""
    removed = []
    for run in _other_runs(root, keep):
        record = read_owner(run)
        if record is not None and owner_alive(record) is False:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed + sweep_stale(root, keep=keep or "")


def sweep_stale(root: str, keep: str, now: float | None = None) -> list[str]:
    """Remove the run directories under ``root`` (other than ``keep``) that no live process uses
    and that have not changed for :data:`STALE_S`; returns those removed."""
    now = time.time() if now is None else now
    removed = []
    for run in _other_runs(root, keep):
        try:
            nodes = [os.path.join(run, n) for n in os.listdir(run)]
            if max([os.stat(run).st_mtime] + [os.stat(n).st_mtime for n in nodes]) > now - STALE_S:
                continue
            fds = []
            try:
                for n in nodes:
                    alive = os.path.join(n, ".alive")
                    if os.path.exists(alive):
                        fd = os.open(alive, os.O_RDWR)
                        fds.append(fd)
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: in use
                shutil.rmtree(run, ignore_errors=True)
                removed.append(run)
            finally:
                for fd in fds:
                    os.close(fd)
        except OSError:
            continue
    if removed:
        logger.info("removed snapshot memory left by runs that ended: %s", removed)
    return removed



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
    """:func:`sweep_runs` of ``root`` and :func:`sweep_reduce_segments` of ``shm_dir`` on this node."""
    removed = (sweep_runs(root, keep) if root else []) + sweep_reduce_segments(shm_dir)
    if removed:
        logger.info("removed node memory whose owner is gone: %s", removed)
    return removed


def sweep_every_node(root: str, keep: str | None, shm_dir: str, wait_s: float | None = None) -> None:
    """Run :func:`sweep_node` on every live Ray node (:func:`~resilient_rl.runtime.cluster.on_every_node`:
    here for this node, as tasks needing no CPU elsewhere). The tasks are not waited for unless
    ``wait_s`` (a start is not delayed by a task's process starting); a node that cannot be
    reached is skipped (logged)."""
    try:
        on_every_node(sweep_node, root, keep, shm_dir, wait_s=wait_s)
    except Exception as exc:  # a node that went away meanwhile: its memory went with it
        logger.warning("sweeping node memory under %s and %s: %s", root, shm_dir, exc)
