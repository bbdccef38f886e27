"""The restore side of a worker's snapshots: the copies a process holds for its ring peers (a
copy on another node, :class:`HeldSnapshots`), and loading a copy (own, node memory, object store
or a peer's) back into the rank's tensors in place, after its checksum is verified
(:class:`SnapshotRestorer`). The take side is :mod:`resilient_rl.workers.snapshots.take`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import ray

from resilient_rl.runtime.dispatch import Dispatch, register
from resilient_rl.workers.snapshots import meta as snapshot_meta
from resilient_rl.workers.snapshots.node_memory import NodeCopy, NodeFiles
from resilient_rl.workers.snapshots.slots import (
    KEEP, previous_publishes_stored,
)
from resilient_rl.workers.snapshots.state import restore_state

logger = logging.getLogger(__name__)


class HeldSnapshots:
    """The copies this rank keeps for its ring peers (a third copy of theirs, on another node), a
    part of a stateful role worker (:mod:`resilient_rl.runtime.parts`). ``process(attr)`` is the
    part ``attr`` of every role in this process, by role: a copy is kept once per process, and
    found by whichever role kept it."""

    def __init__(self, role: str, process: Callable[[str], dict[str, Any]]) -> None:
        self.role = role
        self.process = process
        self.copies: dict = {}  # (owner role, owner rank) -> {step: copy}
        self.lock = threading.Lock()  # the copies: kept on the "snapshot" thread, read on the call thread

    def bytes(self) -> int:
        """Host bytes of the copies kept."""
        with self.lock:
            return sum(int(s["bytes"]) for h in self.copies.values() for s in h.values())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group="snapshot")
    def hold_snapshot(self, step: int, owners: list[list], taken: list, timeout_s: float = 60.0) -> dict:
        """Keep copies of ``step`` taken by other processes (this process is their ring peer):
        ``taken[i]`` is the copies one ``publish_snapshot`` returned (or their ObjectRef, fetched here within
        ``timeout_s``), ``owners[i]`` the ``(role, rank)`` of its copies to keep. Returns
        ``{"step", "kept": copies kept}``.

        It runs on a thread of its own ("snapshot" concurrency group) and the copies arrive as
        references, not as arguments Ray resolves before sending the call: an owner that stops
        before its copy is done then blocks only this call, never the health calls and step
        calls sent to this process after it (Ray sends an actor's calls in order, each once its
        arguments are ready).

        A copy is kept as Ray handed it over (a read-only view of this node's object store,
        which it keeps alive). A rank of this process (its own peer: nothing else to hold it)
        keeps nothing more: its copy is in its own memory and in the object store."""
        previous_publishes_stored(self.process("snapshots").values())
        step = int(step)
        if len(owners) != len(taken):
            raise ValueError(f"hold_snapshot: {len(owners)} owner lists for {len(taken)} snapshots")
        taken = [ray.get(t, timeout=timeout_s) if isinstance(t, ray.ObjectRef) else t for t in taken]
        with self.lock:
            return self._hold(step, owners, taken)

    def _hold(self, step: int, owners: list[list], taken: list) -> dict:
        kept = 0
        for keys, bundle in zip(owners, taken):
            for role, rank in keys:
                snap = bundle["roles"][role]
                local = self.process("snapshots").get(role)
                if local is not None and local.rank == int(rank):
                    continue
                held = self.copies.setdefault((role, int(rank)), {})
                held[step] = snap
                kept += 1
                for old in sorted(held)[:-KEEP]:
                    del held[old]
        return {"step": step, "kept": kept}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held_snapshot(self, step: int, owner_role: str, owner_rank: int) -> dict | None:
        """The copy of ``step`` this process holds for ``owner_role`` rank ``owner_rank`` (kept
        by any of its roles), or None (it was restarted since)."""
        for held in self.process("held_snapshots").values():
            with held.lock:
                snap = (held.copies.get((owner_role, int(owner_rank))) or {}).get(int(step))
                if snap is not None:
                    return snap
        return None


class SnapshotRestorer:
    """Loads a copy of this rank's state (its own, one it left in node memory, one in the object
    store or a peer's) back into the rank's tensors in place, after its checksum is verified; a
    part of a stateful role worker (:mod:`resilient_rl.runtime.parts`). The rank's own copies are
    its :class:`~resilient_rl.workers.snapshots.take.RankSnapshots`' (``snapshots``); a load keeps
    the copy it loaded as the rank's own. ``checkpointer``'s staging is reset before and prepared
    after a load (a checkpoint save stages from the state loaded), and the copy is written through
    its ``while_held`` (a write that finds the GPU held by the process this one replaced waits for it)."""

    def __init__(self, snapshots, checkpointer) -> None:
        self.snapshots = snapshots
        self.checkpointer = checkpointer

    @property
    def rank(self) -> int:
        return self.snapshots.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node_copy_here(self, step: int, source: NodeCopy) -> bool:
        """Whether this rank's copy of ``step`` named by ``source`` is in this node's memory
        (nothing is read into the rank): asked before a copy an earlier controller left is loaded,
        so that a snapshot some rank cannot find here touches no rank."""
        return any(NodeFiles(d, self.snapshots.role, self.rank).has(KEEP, int(step), source.snap_id) for d in source.dirs())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_snapshot(self, step: int, source: Any = None, timeout_s: float = 60.0) -> bool | dict:
        """Fill model, optimizer, schedule and RNG from a snapshot of ``step``; False when the
        copy is not available here (the controller then tries the next source).

        ``source``: None for this process's own copy; a :class:`NodeCopy` for the copy this rank
        left in node memory (read where this process runs: False on another node); ``[ref]`` (an
        ObjectRef wrapped in a list, so that Ray hands it over unresolved) for a copy in the
        object store, read here within ``timeout_s``; a snapshot dict for one handed over by
        value. A copy that does not match the rank's state raises a ValueError naming the first
        path that differs. A copy whose data does not match its checksum (or has none: it was
        never sealed, :meth:`seal_snapshot`; except a node copy, see :meth:`_load_node_copy`) is
        not written into the rank: the answer is then ``{"corrupt": why}`` and the controller
        tries the next source."""
        step = int(step)
        slot = None
        if isinstance(source, NodeCopy):
            return self._load_node_copy(step, source)
        if source is None:
            slot, snap = self.snapshots.own.get(step, (None, None))
        elif isinstance(source, list):
            try:
                snap = ray.get(source[0], timeout=timeout_s)
            except Exception:  # lost with its node, or its task failed: not available
                return False
        else:
            snap = source
        if snap is not None and "roles" in snap:  # what publish_snapshot returned: this role's copy
            snap = snap["roles"].get(self.snapshots.role)
        if snap is None or snap.get("step") != step:
            return False
        started = time.perf_counter()
        why = snapshot_meta.verify(snap)
        if why is not None:
            return self._corrupt(step, "own" if source is None else "copy", why)
        self.checkpointer.reset()
        self._write(snap, step, "own" if source is None else "handed-over", started)
        self.snapshots.keep_own(step, slot, snap)
        self.checkpointer.prepare_staging()
        return True

    def _load_node_copy(self, step: int, source: NodeCopy) -> bool | str:
        """Load the copy of ``step`` this rank left in this node's memory and keep it as its own
        (the slot becomes its ring's: the next take writes the other one).

        A copy its process left unsealed (killed between the take and the seal) has no checksum
        to check, and is loaded as written, answering ``"unsealed"``: its metadata is committed
        only after the copy is complete, and is withdrawn before its slot is written again, so
        it is whole; a flipped bit in it would go unseen."""
        for where in source.dirs():
            files = NodeFiles(where, self.snapshots.role, self.rank)
            found = files.find(KEEP, step, source.snap_id)
            if found is not None:
                break
        else:
            return False
        slot, meta, buf = found
        snap = dict(meta, data=buf.numpy())
        unsealed = "checksum" not in meta
        started = time.perf_counter()
        why = None if unsealed else snapshot_meta.verify(snap)
        if why is not None:
            return self._corrupt(step, "node", why)
        if unsealed:
            logger.info("%s rank %d: node copy of step %d was left unsealed (its process died before its "
                        "checksum); loaded as written", self.snapshots.role, self.rank, step)
        self.checkpointer.reset()
        self._write(snap, step, "node", started)
        if not files.still(slot, source.snap_id):  # written over while read: no process should be
            logger.warning("%s rank %d: node copy of step %d changed while read", self.snapshots.role, self.rank, step)
            return False
        self.snapshots.adopt_node_copy(source.run_dir, step, slot, buf, snap)
        self.checkpointer.prepare_staging()
        return "unsealed" if unsealed else True

    def _write(self, snap: dict, step: int, where: str, started: float) -> None:
        """Write the checked ``snap`` into the rank (:meth:`restore_snapshot_state`) and log how
        long its check (since ``started``) and its writing took: a recovery's restore phase is
        these two, on every rank at once."""
        checked = time.perf_counter()
        self.checkpointer.while_held(lambda: self.restore_snapshot_state(snap), self.snapshots.states(),
                                     "its snapshot restore")
        logger.info("%s rank %d: restored step %d from its %s copy, %.2f GB: checked in %.2f s, written in %.2f s",
                    self.snapshots.role, self.rank, step, where, int(snap.get("bytes", 0)) / 1e9, checked - started,
                    time.perf_counter() - checked)

    def _corrupt(self, step: int, where: str, why: str) -> dict:
        """The answer of a load that found its copy damaged (nothing was written into the rank)."""
        logger.warning("%s rank %d: %s copy of snapshot step %d is damaged, not restored: %s",
                       self.snapshots.role, self.rank, where, step, why)
        return {"corrupt": why}

    def restore_snapshot_state(self, snap: dict) -> None:
        """Write ``snap`` into the engine in place: tensors, optimizer hyperparameters and
        non-tensor state, scheduler, RNG. Bit-identical to the state it was taken from."""
        restore_state(self.snapshots.states().engine, snap, self.snapshots.tensors)
