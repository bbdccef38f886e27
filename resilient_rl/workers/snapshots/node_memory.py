"""Node memory for in-memory snapshots: a rank's ring buffers as files in a node-shared tmpfs.

A rank's snapshot ring (:class:`~resilient_rl.workers.snapshots.buffers.HostRing`) lives, where
the controller names a directory (``recovery.snapshot_node_dir``, ``/dev/shm`` by default), in
memory-mapped files there instead of the process's own memory. The copy costs the same memory
copy, and it outlives the process: a restarted process or a spare of the same rank on the same
node reads it back, without a copy of the state through Ray's object store after every
snapshot (which costs each snapshot an object to create, seal, pin and free).

Layout, one directory per run and node (:func:`node_path`)::

    <root>/resilient-rl-<run>-<controller>/<node id>/
        .alive                          shared lock held by every process using the directory
        <role>-<rank>-<slot>.data       the packed tensors (preallocated with posix_fallocate)
        <role>-<rank>-<slot>.meta       the snapshot without its data, written last (JSON and the
                                        tensor layout, :mod:`resilient_rl.workers.snapshots.meta`)

Directories are created 0700 and files 0600: a snapshot is the model and optimizer state, for
this user's processes only; and nothing read from them is unpickled.

The ``.meta`` file is the commit marker: a take first removes the slot's ``.meta``, then copies
into ``.data``, then writes the new ``.meta`` (to a temporary name, renamed over). A reader
(:meth:`NodeFiles.find`) trusts only a slot whose ``.meta`` names the snapshot it was asked for
(step and the controller's id of that snapshot), and checks again after reading
(:meth:`NodeFiles.still`); the data's checksum in the ``.meta`` is checked before the copy is
used. A slot's data file is never written again in place once mapped by a new ring: every
mapping starts from a fresh file (the old one is unlinked first, so a reader that still maps it
keeps reading its own bytes). The space is reserved up front (``posix_fallocate``): a tmpfs too
small for the ring fails the reservation with an OSError, never a SIGBUS during the copy.

Directories are removed by the controller at the end of a run (:func:`remove_run`, on every
node). One left by a controller that is gone (killed, or preempted with no warning) is removed by
the next controller of the same run when it starts snapshotting (:func:`remove_predecessors`),
once it has tried to continue from it; by a sweep of any run on the same node once its owner (the
controller named in its ``.owner``) is gone and the owner's keep (``recovery.snapshot_hand_over_s``)
has passed, at once where it holds no committed snapshot; and sooner by a live run whose ring
would leave the node short (:func:`make_room`). One whose owner cannot be checked from the node is
removed once no process holds its ``.alive`` lock and it has not changed for
:data:`~resilient_rl.workers.snapshots.node_sweep.STALE_S`
(:mod:`resilient_rl.workers.snapshots.node_sweep`).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import shutil
from typing import Any, Callable

import torch
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from resilient_rl.errors import CheckpointError
from resilient_rl.workers.snapshots import meta as snapshot_meta, node_capacity, node_sweep
from resilient_rl.workers.snapshots.node_sweep import PREFIX
from resilient_rl.workers.snapshots.sizing import HEADROOM

logger = logging.getLogger(__name__)

#: Seconds a reservation that finds no space keeps taking kept room and trying again (see _reserve).
RESERVE_WAIT_S = 2.0


_ALIVE: dict[str, int] = {}  # directory -> fd of its .alive file, locked shared by this process


@dataclasses.dataclass(frozen=True)
class NodeCopy:
    """Where a rank finds a snapshot in node memory: the run's directory (``<root>/resilient-rl-
    <run>``, this node's part of it is read) and the controller's id of the snapshot.

    ``any_node``: look in every part of the directory this machine holds. A copy an earlier
    controller's cluster left is under that cluster's node ids, which a new cluster does not reuse
    (its files are named by role and rank, so a rank finds its own wherever it is)."""

    run_dir: str
    snap_id: str
    any_node: bool = False

    def dirs(self) -> list[str]:
        """The node directories to look in: this node's first."""
        here = node_path(self.run_dir)
        if not self.any_node:
            return [here]
        try:
            parts = sorted(os.path.join(self.run_dir, d) for d in os.listdir(self.run_dir))
        except OSError:
            parts = []
        return [here] + [p for p in parts if p != here and os.path.isdir(p)]


def node_id() -> str:
    """This process's Ray node id ("local" outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # pragma: no cover - an old or partly started Ray: one node
        pass
    return "local"


def node_path(run_dir: str) -> str:
    """This node's directory of the run directory ``run_dir`` (``<root>/resilient-rl-<run>``)."""
    return os.path.join(run_dir, node_id())


def run_path(root: str, run: str, controller: str) -> str:
    """The directory of run ``run`` (a key of the run's folder) as one controller ``controller``
    drives it: ``<root>/resilient-rl-<run>-<controller>``."""
    return os.path.join(root, f"{PREFIX}{run}-{controller}")


def remove_run(path: str) -> None:
    """Remove a run's directory on this node (nothing when there is none)."""
    shutil.rmtree(path, ignore_errors=True)


def remove_predecessors(path: str) -> list[str]:
    """Remove the directories that earlier controllers of the run of ``path`` (a
    :func:`run_path`) left on this node: a run has one controller at a time (its lease), so
    theirs are no longer used. Returns those removed."""
    root, name = os.path.split(path)
    run = name.rsplit("-", 1)[0] + "-"
    try:
        names = [n for n in os.listdir(root) if n.startswith(run) and n != name and "-" not in n[len(run):]]
    except OSError:
        return []
    for n in names:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return [os.path.join(root, n) for n in names]


def make_room(run: str, nbytes: int, free: Callable[[str], int] | None = None) -> list[str]:
    """Before ``nbytes`` more of run directory ``run`` are reserved: where that would leave its
    node short (less than :data:`~resilient_rl.workers.snapshots.sizing.HEADROOM` x ``nbytes``
    free in the tmpfs or in RAM), take the memory kept for the next controllers of runs whose
    controller is gone (:func:`~resilient_rl.workers.snapshots.node_sweep.sweep_runs` with
    ``reclaim``): a live run comes first. Returns the directories removed."""
    if (free or node_capacity.free_bytes)(run) >= HEADROOM * nbytes:
        return []
    return reclaim(run)


def reclaim(run: str) -> list[str]:
    """Take the memory kept beside run directory ``run`` for the next controllers of runs whose
    controller is gone; the directories removed."""
    return node_sweep.sweep_runs(os.path.dirname(run), keep=run, reclaim=True)


def _no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _reserve(fd: int, nbytes: int, run: str) -> None:
    """Reserve ``nbytes`` for ``fd``, a new file of run directory ``run``. Where the node has no
    space left, take the room kept for gone controllers (:func:`reclaim`) and try again, for up
    to :data:`RESERVE_WAIT_S`: another process of the node may have reserved its slot since
    :func:`make_room` measured, or be removing a kept directory itself (a removed file's pages
    are freed a moment after its name is gone). Then an OSError that says where the room went
    (:func:`~resilient_rl.workers.snapshots.node_capacity.room_report`)."""
    try:
        for attempt in Retrying(retry=retry_if_exception(_no_space), stop=stop_after_delay(RESERVE_WAIT_S),
                                wait=wait_exponential(multiplier=0.02, max=0.5),
                                before_sleep=lambda _: reclaim(run), reraise=True):
            with attempt:
                os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if not _no_space(exc):
            raise
        raise OSError(exc.errno, f"{exc.strerror}: {node_capacity.room_report(run, nbytes)}") from exc


def make_private_dirs(path: str) -> None:
    """Create ``path`` and its parents up to the node-memory root, each 0700 (whatever the umask),
    a directory that exists already made 0700 too where it is a run directory of ours."""
    run = os.path.dirname(path)
    for d in (run, path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)


def _hold_alive(directory: str) -> None:
    if directory in _ALIVE:
        return
    fd = os.open(os.path.join(directory, ".alive"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _ALIVE[directory] = fd


class NodeFiles:
    """The ring files of one rank (``role``, ``rank``) in a node directory."""

    def __init__(self, directory: str, role: str, rank: int, owner: dict | None = None) -> None:
        self.dir, self.role, self.rank = directory, role, int(rank)
        self.owner = owner  # the controller's node_sweep.owner_record(), written as the run's .owner

    def open(self) -> None:
        """Create the directory (0700), mark it in use by this process, name the run's owner, and
        remove the runs beside it whose owner is gone."""
        first = not os.path.isdir(self.dir)
        make_private_dirs(self.dir)
        _hold_alive(self.dir)
        run = os.path.dirname(self.dir)
        if self.owner is not None:
            node_sweep.write_owner(run, self.owner)
        if first:
            node_sweep.sweep_runs(os.path.dirname(run), keep=run)

    def _path(self, slot: int, ext: str) -> str:
        return os.path.join(self.dir, f"{self.role}-{self.rank}-{slot}.{ext}")

    def map(self, slot: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over slot ``slot``'s data file of ``nbytes`` bytes, its space
        reserved (an OSError, e.g. ENOSPC, when the directory cannot hold it)."""
        self.open()
        path = self._path(slot, "data")
        # A fresh file, never the old one's pages: whoever still maps the old one (a reader of the
        # copy it held, a process of the rank before this one) keeps reading what it held.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        run = os.path.dirname(self.dir)
        make_room(run, nbytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                _reserve(fd, nbytes, run)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def invalidate(self, slot: int) -> None:
        """Withdraw slot ``slot``'s snapshot (before its data is written again)."""
        try:
            os.unlink(self._path(slot, "meta"))
        except FileNotFoundError:
            pass

    def commit(self, slot: int, meta: dict) -> None:
        """Publish slot ``slot``'s snapshot (``meta``: the snapshot without its data, with its
        ``id``) once its data is complete."""
        path = self._path(slot, "meta")
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(snapshot_meta.encode(meta))
        os.replace(tmp, path)

    def _meta(self, slot: int) -> dict | None:
        path = self._path(slot, "meta")
        try:
            with open(path, "rb") as f:
                return snapshot_meta.decode(f.read(), path)
        except OSError:
            return None
        except CheckpointError as exc:  # not this format (or damaged): not a copy to offer
            logger.warning("%s", exc)
            return None

    def find(self, slots: int, step: int, snap_id: Any) -> tuple[int, dict, torch.Tensor] | None:
        """(slot, snapshot without data, its data) of the committed snapshot ``snap_id`` of
        ``step``, or None when this node has none."""
        if not os.path.isdir(self.dir):
            return None
        for slot in range(slots):
            meta = self._meta(slot)
            if meta is None or meta.get("step") != step or meta.get("id") != snap_id:
                continue
            path = self._path(slot, "data")
            try:
                if os.path.getsize(path) < int(meta["bytes"]):
                    continue
            except OSError:
                continue
            self.open()
            return slot, meta, torch.from_file(path, shared=True, size=int(meta["bytes"]), dtype=torch.uint8)
        return None

    def has(self, slots: int, step: int, snap_id: Any) -> bool:
        """Whether this node holds the committed snapshot ``snap_id`` of ``step`` (without mapping it)."""
        for slot in range(slots):
            meta = self._meta(slot)
            if meta is None or meta.get("step") != step or meta.get("id") != snap_id:
                continue
            try:
                return os.path.getsize(self._path(slot, "data")) >= int(meta["bytes"])
            except (OSError, KeyError, TypeError, ValueError):
                return False
        return False

    def still(self, slot: int, snap_id: Any) -> bool:
        """Whether slot ``slot`` still holds snapshot ``snap_id`` (checked after reading it)."""
        meta = self._meta(slot)
        return meta is not None and meta.get("id") == snap_id
