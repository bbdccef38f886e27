"""Worker side of in-memory snapshots: a rank's state copied to host memory after a step.

A snapshot is the rank's state as a checkpoint sees it (model and optimizer shards, LR schedule,
RNG), taken straight from the engine's tensors (no state dict is built): the tensors are packed
into a preallocated host buffer (:mod:`resilient_rl.workers.snapshots.buffers`), the few
non-tensor parts (scheduler, optimizer hyperparameters, RNG) ride along as plain values.
:meth:`RankSnapshots.take_snapshot` keeps the newest copies (:data:`KEEP` buffers, reused in
turn) in node memory where the controller names a directory
(:mod:`resilient_rl.workers.snapshots.node_memory`: they outlive the process, and a new process of the rank
on the same node loads them back), else in the process.
:meth:`RankSnapshots.publish_snapshot`, where the controller asks for it (a peer on another node
needs the copies, or they are not in node memory), returns them from the process's "snapshot"
thread, so the controller's object reference keeps a copy in Ray's object store (owned by the
controller: it outlives this process) while the next step runs. One call of each covers every
stateful role the process hosts (colocated roles): a process puts one object per snapshot.
:meth:`RankSnapshots.seal_snapshot`, also on the "snapshot" thread (off the step's path),
checksums the copies (:mod:`resilient_rl.workers.snapshots.meta`) and commits those in node memory;
every load checks the checksum before writing anything into the rank, so a torn or damaged copy
is refused (``{"corrupt": why}``) and the controller tries the next one.
:meth:`HeldSnapshots.hold_snapshot` makes this process keep its ring neighbours' copies (a third
copy, on another node), all of one step in one call. :meth:`SnapshotRestorer.load_snapshot` writes a
copy back into the rank's tensors in place; both are the restore side
(:mod:`resilient_rl.workers.snapshots.restore`).

A snapshot (a dict) is self-describing: ``layout`` names each packed tensor with its dtype,
shape and offset in ``data`` (a flat uint8 NumPy array, which Ray moves out of band, without
pickling tensors); loading checks it name by name against the rank's tensors and raises a
ValueError naming the first path that differs.

The copy runs on the worker's call thread, in chunks that each report progress; the waits on a
GPU copy and the memory copies themselves release the GIL, so the health concurrency group keeps
answering while a large state is copied.

Snapshots are never resharded: a copy is loaded only into the same rank of the same world size
(the controller falls back to a storage checkpoint otherwise).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import ray
import torch

from resilient_rl.runtime.dispatch import Dispatch, register
from resilient_rl.workers.snapshots import meta as snapshot_meta, node_capacity
from resilient_rl.workers.snapshots.node_memory import NodeFiles, node_id, node_path
from resilient_rl.workers.snapshots.buffers import HostRing, Layout
from resilient_rl.workers.snapshots.slots import (
    KEEP, previous_publishes_stored,
)
from resilient_rl.workers.snapshots.state import FORMAT, optim_extras

logger = logging.getLogger(__name__)

#: Seconds a take waits for a ring slot that a publish may still be reading, before it gives that
#: slot a new buffer (the publish keeps reading the old one). In a steady run no take waits: the
#: slot's publish was stored while the step ran.
SLOT_WAIT_S = 2.0


class RankSnapshots:
    """This rank's own snapshot copies, a part of a stateful role worker
    (:mod:`resilient_rl.runtime.parts`): taken from the rank's state registry (``states()``, a
    :class:`~resilient_rl.workers.rank_state.RankState`) into a ring of host buffers, published to
    the object store, sealed with a checksum; :class:`~resilient_rl.workers.snapshots.restore.SnapshotRestorer`
    loads them back. ``place()`` is the rank's (rank, world size); ``process(attr)`` the part
    ``attr`` of every role in this process, by role
    (:meth:`~resilient_rl.runtime.rank_host.RankHost.parts`): one call takes, publishes or seals
    the copies of every colocated role."""

    def __init__(self, role: str, states: Callable[[], Any], place: Callable[[], tuple[int, int]],
                 process: Callable[[str], dict[str, Any]]) -> None:
        self.role = role
        self.states = states
        self.place = place
        self.process = process
        self.own: dict = {}  # step -> (ring slot or None, this rank's copy)
        self.take_failed: tuple[int, str] | None = None  # (step, why) of the last take that raised
        self.publishing: frozenset = frozenset()  # ring slots whose copy a publish handed to Ray to store
        self.ring: HostRing | None = None
        self.layout: Layout | None = None
        self.node_failed: tuple[str, str] | None = None  # (run directory, why) where node memory failed
        self.to_commit: dict = {}  # step -> NodeFiles its seal commits the copy to
        #: Guards the own copies and the ring slots a publish may still be reading, across the call
        #: thread (takes) and the "snapshot" thread (publishes, seals); notified when either changes.
        self.slots = threading.Condition()

    @property
    def rank(self) -> int:
        return self.place()[0]

    def ring_for(self, node: dict | None) -> HostRing:
        """The ring for a take: in node memory of the run directory ``node["dir"]`` when given
        (and usable here), else in this process's memory. A new ring starts with no kept copy."""
        run_dir = (node or {}).get("dir")
        if run_dir is not None and self.node_failed is not None and self.node_failed[0] == run_dir:
            run_dir = None  # it failed here before: the controller publishes this rank's copies
        ring = self.ring
        want = None if run_dir is None else (node_path(run_dir), self.role, self.rank)
        have = None if ring is None or ring.files is None else (ring.files.dir, ring.files.role, ring.files.rank)
        if ring is None or have != want:
            if ring is not None:
                ring.release()
            ring = self.ring = HostRing(KEEP, None if want is None else NodeFiles(*want, node.get("owner")))
            with self.slots:
                self.own = {s: v for s, v in self.own.items() if v[0] is None}
                self.publishing = frozenset()
        return ring

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.states().tensors()

    def _free_slot(self) -> int:
        """A ring slot no kept copy lives in and no publish reads, after dropping own copies beyond
        the newest KEEP - 1. Waits (up to :data:`SLOT_WAIT_S`) for a publish still being stored;
        past that, the slot gets a new buffer and the publish keeps the old one."""
        with self.slots:
            own = self.own
            for old in sorted(own)[:-(KEEP - 1) or None]:
                del own[old]
            kept = {slot for slot, _ in own.values()}
            free = lambda: [s for s in range(KEEP) if s not in kept and s not in self.publishing]  # noqa: E731
            if self.slots.wait_for(free, timeout=SLOT_WAIT_S):
                return free()[0]
            slot = next(s for s in range(KEEP) if s not in kept)
            self.ring.forget(slot)
            self.publishing = self.publishing - {slot}
            return slot

    def _take(self, step: int, node: dict | None = None) -> dict:
        """Copy this rank's state into a ring buffer; keep the copy and return it."""
        try:
            try:
                slot, snap = self._copy(step, node)
            except OSError as exc:
                if node is None or self.ring is None or self.ring.files is None:
                    raise
                # Node memory cannot hold the ring (a small tmpfs, a missing directory): this
                # rank keeps its copies in its own memory; the controller publishes them.
                self.node_failed = (node["dir"], f"{type(exc).__name__}: {exc}")
                logger.warning("snapshot node memory under %s is unusable for %s rank %d (%s): "
                               "copies stay in the process and go to the object store",
                               node["dir"], self.role, self.rank, exc)
                slot, snap = self._copy(step, node)
        except BaseException as exc:
            with self.slots:
                self.take_failed = (step, f"{type(exc).__name__}: {exc}")
                self.slots.notify_all()
            raise
        self.keep_own(step, slot, snap)
        return snap

    def keep_own(self, step: int, slot: int | None, snap: dict) -> None:
        with self.slots:
            self.own[step] = (slot, snap)
            self.slots.notify_all()

    def adopt_node_copy(self, run_dir: str, step: int, slot: int, buf, snap: dict) -> None:
        """Make the copy of ``step`` a load read from node memory (in ring slot ``slot`` of the run
        directory ``run_dir``, buffer ``buf``) this rank's one own copy: the next take writes the
        other slot."""
        self.node_failed = None
        ring = self.ring_for({"dir": run_dir})
        with self.slots:
            self.own = {}
        ring.adopt(slot, buf)
        self.keep_own(step, slot, snap)

    def _copy(self, step: int, node: dict | None) -> tuple[int, dict]:
        """Pack this rank's state into a free ring slot: (the slot, the snapshot). In node memory
        the slot's old snapshot is withdrawn first and the new one committed last."""
        ring = self.ring_for(node)
        tensors = self.tensors()
        if self.layout is None or not self.layout.matches(tensors):
            self.layout = Layout.of(tensors)
        layout = self.layout
        with self.slots:
            self.own.pop(step, None)
        slot = self._free_slot()
        if ring.files is not None:
            ring.files.invalidate(slot)
        data = ring.copy_out(layout, [t for _, t in tensors], slot)
        rank, world_size = self.place()
        groups, scalars = optim_extras(self.states().engine.optimizer)
        snap = {"format": FORMAT, "step": step, "rank": rank, "world_size": world_size,
                "bytes": int(layout.total), "layout": layout.to_list(), "data": data,
                "extra": {"param_groups": groups, "optim_scalars": scalars,
                          "states": self.states().plain_state()}}
        if ring.files is not None:
            # Committed in node memory now, whole but not yet checksummed: a process killed
            # before its seal leaves a copy its restarted process can still load. The seal
            # commits it again with its checksum.
            snap["id"] = node["id"]
            ring.files.commit(slot, {k: v for k, v in snap.items() if k != "data"})
            self.to_commit[step] = ring.files
        return slot, snap

    def _process_workers_of(self, roles: list[str] | None, call: str) -> dict[str, "RankSnapshots"]:
        """role -> its worker in this process at this rank, for each of ``roles`` (default: this
        role); a role not hosted here at this rank raises a ValueError."""
        out = {}
        for role in roles or [self.role]:
            worker = self if role == self.role else self.process("snapshots").get(role)
            if worker is None or worker.rank != self.rank:
                raise ValueError(f"{call}: this process hosts no {role} rank {self.rank}")
            out[role] = worker
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_snapshot(self, step: int, roles: list[str] | None = None, node: dict | None = None) -> dict:
        """Copy the state of this rank and of the ``roles`` colocated with it in this process
        (default: this role only) to host memory and keep the copies: one call per process however
        many stateful roles it hosts. Returns ``{"step", "bytes": {role: bytes of its copy},
        "node_failed": {role: why}}``; :meth:`publish_snapshot` hands the copies to the object
        store.

        ``node``: ``{"dir": the run's node-memory directory, "id": the snapshot's id}`` to keep
        the copies in node memory (:mod:`resilient_rl.workers.snapshots.node_memory`), where they outlive
        this process; a role whose copy could not go there is named in ``node_failed``.

        A snapshot (the copy of one role) is ``{"format", "step", "rank", "world_size", "bytes",
        "layout", "data", "extra"}``, its ``data`` a view of the rank's ring buffer, valid until
        :data:`KEEP` later snapshots."""
        step = int(step)
        workers = self._process_workers_of(roles, "take_snapshot")
        sizes = {role: int(w._take(step, node)["bytes"]) for role, w in workers.items()}
        failed = {role: w.node_failed[1] for role, w in workers.items()
                  if node is not None and w.node_failed is not None and w.node_failed[0] == node["dir"]}
        return {"step": step, "bytes": sizes, "node_failed": failed}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group="snapshot", num_returns=2)
    def publish_snapshot(self, step: int, roles: list[str] | None = None, timeout_s: float = 60.0) -> tuple[dict, dict]:
        """The copies :meth:`take_snapshot` made of ``step`` for ``roles``, returned so that Ray
        stores them in the object store (owned by the caller, they outlive this process): one
        object per process.

        It runs on the "snapshot" thread, so that Ray's copy into the object store overlaps the
        next step's calls instead of delaying them; it waits up to ``timeout_s`` for the take
        (sent before it, running on the call thread) and raises a RuntimeError when the take
        failed or its copy is gone. The ring slots it returns are not written again before
        Ray has stored them (the next call on this thread).

        Returns two values (two ObjectRefs through Ray): ``{"step"}``, which tells that the copies
        are stored without fetching them, and ``{"step", "rank", "roles": {role: snapshot}}``."""
        previous_publishes_stored(self.process("snapshots").values())
        step = int(step)
        workers = self._process_workers_of(roles, "publish_snapshot")
        out = {}
        for role, w in workers.items():
            with w.slots:
                w._wait_taken(step, timeout_s, "publish_snapshot")
        for role, w in workers.items():
            if "checksum" not in w.own.get(step, (None, {}))[1]:
                w._seal(step, timeout_s)
        for role, w in workers.items():
            with w.slots:
                if step not in w.own:
                    raise RuntimeError(f"publish_snapshot: the {role} copy of step {step} is gone (superseded)")
                slot, out[role] = w.own[step]
                if slot is not None:
                    w.publishing = w.publishing | {slot}
        return {"step": step}, {"step": step, "rank": self.rank, "roles": out}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group="snapshot")
    def seal_snapshot(self, step: int, roles: list[str] | None = None, timeout_s: float = 60.0) -> dict:
        """Checksum the copies :meth:`take_snapshot` made of ``step`` for ``roles`` and, where
        they are in node memory, commit them there again with the checksum (the take committed them
        without): a copy is loaded only once sealed, except where its process died before its
        seal (see ``load_snapshot``). Runs on the "snapshot" thread, off the step's path; waits up
        to ``timeout_s`` for the take and raises a RuntimeError when it failed. The slot is not
        written again while it is read. Returns ``{"step", "checksums": {role: checksum}}``."""
        previous_publishes_stored(self.process("snapshots").values())
        step = int(step)
        workers = self._process_workers_of(roles, "seal_snapshot")
        return {"step": step, "checksums": {role: w._seal(step, timeout_s) for role, w in workers.items()}}

    def _wait_taken(self, step: int, timeout_s: float, call: str) -> None:
        """With :attr:`slots` held: wait up to ``timeout_s`` for the take of ``step`` (sent before ``call``,
        running on the call thread); a RuntimeError when it failed or its copy is gone."""
        role = self.role
        taken = lambda: step in self.own or (self.take_failed or (None,))[0] == step  # noqa: E731
        if not self.slots.wait_for(taken, timeout=timeout_s):
            raise RuntimeError(f"{call}: no {role} copy of step {step} after {timeout_s:.0f}s")
        if step not in self.own:
            why = self.take_failed[1] if self.take_failed and self.take_failed[0] == step else "superseded"
            raise RuntimeError(f"{call}: the {role} copy of step {step} is gone ({why})")

    def _seal(self, step: int, timeout_s: float) -> str:
        role = self.role
        with self.slots:
            self._wait_taken(step, timeout_s, "seal_snapshot")
            slot, snap = self.own[step]
            reading = slot is not None and slot not in self.publishing
            if reading:  # a take waits for it (see _free_slot)
                self.publishing = self.publishing | {slot}
        try:
            digest = snap.get("checksum") or snapshot_meta.checksum(snap["data"], int(snap["bytes"]))
        finally:
            with self.slots:
                still = self.own.get(step, (None, None))[1] is snap and (
                    slot is None or slot in self.publishing)
                if reading:
                    self.publishing = self.publishing - {slot}
                self.slots.notify_all()
        snap["checksum"] = digest
        files = self.to_commit.pop(step, None)
        for old in [s for s in self.to_commit if s < step]:
            del self.to_commit[old]
        if not still:
            # The slot was given to a newer take meanwhile (its reader was too slow): this copy is
            # no longer in node memory, so nothing is committed there.
            raise RuntimeError(f"seal_snapshot: the {role} copy of step {step} was superseded while sealed")
        if files is not None and files is (self.ring.files if self.ring else None):
            files.commit(slot, {k: v for k, v in snap.items() if k != "data"})
        return digest

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot_sizing(self, roles: list[str] | None = None, node_dir: str = "") -> dict:
        """For ``recovery.snapshot_every=auto``: ``{"node": this node's id, "bytes": {role: bytes
        of one snapshot copy}}`` for ``roles`` in this process at this rank, and ``"room"``: what
        this node can hold (:func:`resilient_rl.workers.snapshots.node_capacity.measure` of ``node_dir``)."""
        workers = self._process_workers_of(roles, "snapshot_sizing")
        return {"node": node_id(), "room": node_capacity.measure(node_dir),
                "bytes": {role: int(Layout.of(w.tensors()).total) for role, w in workers.items()}}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def has_snapshot(self, step: int) -> bool:
        """Whether this process still has its own copy of ``step``."""
        return int(step) in self.own

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot_memory(self) -> dict:
        """Host bytes this rank spends on snapshots: its ring buffers (own copies) and the
        neighbours' copies it holds."""
        ring = self.ring
        own = sum(b.numel() for b in ring.buffers if b is not None) if ring is not None else 0
        own += sum(int(s["bytes"]) for slot, s in self.own.values() if slot is None)
        held = self.process("held_snapshots").get(self.role)
        return {"own_bytes": own, "held_bytes": held.bytes() if held is not None else 0}
