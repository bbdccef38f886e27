"""Controller side of in-memory snapshots: take them after a step, restore the newest after a failure.

Every ``recovery.snapshot_every`` steps (``auto``: sized after the first step, :meth:`SnapshotKeeper.size`), :meth:`SnapshotKeeper.take` asks every rank of every
stateful role (actor, critic) to copy its state to host memory (``take_snapshot``, one call per
process for the stateful roles it hosts). The ranks keep their copies in node memory
(:mod:`resilient_rl.workers.snapshots.node_memory`, under ``recovery.snapshot_node_dir`` in a directory of
this controller's own), where they outlive the process. Then it asks each rank's ring peer on
another node to keep a copy too (``hold_snapshot``: the next stateful rank, of any stateful role,
in ring order on another node; one call per holding process); the copies for a peer travel
through Ray's object store (``publish_snapshot``, on the process's "snapshot" thread, so the
store's copy overlaps the next step; the object stays owned by this controller). A process whose
node memory is unusable (its take says so: that snapshot does not count) publishes from then on,
so the object store keeps its copy instead; so do all with ``snapshot_node_dir=""``. A peer on
the rank's own node would keep nothing that outlives what node memory or the object store keeps,
so none is asked there (unless neither is read, see below: then the next rank in another process
keeps one). Nothing is waited for: the calls queue behind the step on the workers and overlap
the controller's own work. The controller keeps, per snapshot, the object references, which rank
holds which copy and its own state (``trainer.state_dict()``) of that step.

Each process checksums its copies on its "snapshot" thread after the take (``seal_snapshot``,
off the step's path; a copy in node memory, committed there by the take, is committed again with
its checksum), and every load checks
the checksum before writing anything into the rank: a copy that fails it (torn, flipped) is
reported (``snapshot_corrupt``, ``rrl_snapshot_corrupt_total``) and never restored; the rank
tries its next copy, then an older snapshot, then storage.

A snapshot is **complete** when every take, seal, publish and hold of every rank has finished without
an error (checked without waiting, at use, from their small answers: no copy is fetched): the
same all-ranks rule as a checkpoint commit. Only the newest complete snapshot and the ones in
flight after it are kept.

:meth:`SnapshotKeeper.restore` loads the newest complete snapshot that is not older than the last
committed checkpoint and was taken at the current world sizes (snapshots are never resharded).
A newer one that a process's death left **unfinished** (every answer in, the only failed ones of
processes that died: a failure striking while it was being sealed) is tried first, once the
survivors' answers still in flight are in: the dead processes' ranks are filled first, so that
where one of them has no whole copy left no surviving rank was touched.
Each rank is filled from the first copy that is still there: its own (its process survived), its
node memory's (its new process runs on the same node), the object store's (skipped when
``recovery.max_task_retries`` > 0, where Ray could rebuild a lost copy by re-running the snapshot
on the restarted actor), its peer's. When a rank's copies are all lost (its node and its peer's
went down together, or its node where no other node has a stateful rank) the snapshot is
unusable; the caller rebuilds the models and falls back to storage.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import uuid
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError

from resilient_rl.workers.snapshots import carry as snapshot_carry
from resilient_rl.workers.snapshots.loading import SnapshotLoader
from resilient_rl.workers.snapshots.ring import process_key, processes, ring_holders
from resilient_rl.workers.snapshots.sizing import decide
from resilient_rl.runtime.cluster import on_every_node
from resilient_rl.workers.snapshots.node_memory import NodeCopy, remove_predecessors, remove_run, run_path
from resilient_rl.workers.snapshots.node_sweep import owner_record
from resilient_rl.workers.snapshots.slots import KEEP
from resilient_rl.workers.snapshots.tracked import Snapshot

logger = logging.getLogger(__name__)

#: Most snapshots kept at once: the newest complete one and those in flight after it.
MAX_KEPT = 3


class SnapshotKeeper:
    """Takes, tracks and restores in-memory snapshots (see the module docstring).

    Args:
        cfg: the ``recovery`` config section (``snapshot_every``, ``max_task_retries``,
            ``call_timeout_s``).
        emit: ``emit(kind, **fields)`` records an event of the run.
        run_key: the run's key (:attr:`RunDir.key`), the same for each controller of the run.
        wait, get: ``ray.wait`` and ``ray.get``, replaced by fakes in tests.
        record_path: where each snapshot is recorded for a later controller of the run
            (:mod:`resilient_rl.workers.snapshots.carry`); None: nowhere.
    """

    def __init__(self, cfg, emit: Callable[..., None] = lambda kind, **f: None,
                 wait: Callable = ray.wait, get: Callable = ray.get, clock: Callable[[], float] = time.perf_counter,
                 *, run_key: str, record_path: str | None = None):
        self.record_path = record_path
        self.hand_over = False  # set when the run stops preempted: close() leaves node memory to the next controller
        self.every = cfg.snapshot_every  # "auto" until sized (:meth:`size`)
        self.use_node_memory = True  # False where auto sizing found node memory too small
        self.sizing: Any = None  # the auto decision (snapshot_sizing.Decision), once made
        self.object_store_ok = cfg.max_task_retries == 0
        root = cfg.snapshot_node_dir
        # This run's node-memory directory (one part per node), unique to this controller; an
        # earlier controller's of the same run is removed at the first snapshot.
        self.node_dir = run_path(root, run_key, uuid.uuid4().hex[:12]) if root else None
        self._predecessors_removed = root == ""
        # This controller: a sweep on any node removes its memory once it is gone and its keep has passed.
        self.owner = owner_record(keep_s=cfg.snapshot_hand_over_s)
        self.no_node: set = set()  # processes whose node memory failed: their copies are published
        self._taken = 0
        self.timeout_s = min(cfg.call_timeout_s, 120.0)
        self.emit = emit
        self.loader = SnapshotLoader(self.timeout_s, emit, self.object_store_ok)
        self._wait, self._get, self.clock = wait, get, clock
        self.snapshots: list[Snapshot] = []  # oldest first
        self._recorded: list[dict] = []  # what the record names (snapshot_carry), newest first
        self.partial = False  # whether the last restore that found no usable snapshot loaded some ranks

    # ------------------------------------------------------------------ take
    def due(self, step: int) -> bool:
        return isinstance(self.every, int) and self.every > 0 and step % self.every == 0

    def size(self, roles) -> None:
        """Resolve ``snapshot_every=auto`` once, from the copies' bytes and what each node can hold
        (:mod:`resilient_rl.workers.snapshots.sizing`), and log the one line that says which and
        why. Called after a step (the optimizer has its state); nothing when already resolved."""
        if self.every != "auto":
            return
        groups = dict(roles.checkpoint_groups())
        places = roles.role_processes()
        ranks = [(role, r) for role, g in groups.items() for r in range(g.world_size)]
        asked = []
        for members in processes(ranks, places).values():
            (role0, r0), here = members[0], [role for role, _ in members]
            asked.append((groups[role0], groups[role0].execute_rank_async(
                r0, "snapshot_sizing", here, self.node_dir and os.path.dirname(self.node_dir))))
        reports = [g.get([ref], timeout_s=self.timeout_s)[0] for g, ref in asked]
        self.sizing = decide(reports, KEEP, self.node_dir and os.path.dirname(self.node_dir) or "")
        self.every, self.use_node_memory = self.sizing.every, self.sizing.node_memory
        if self.every == 1:
            logger.info(self.sizing.line)
        else:
            logger.warning(self.sizing.line)

    def take(self, roles, step: int, trainer_state: dict) -> Snapshot:
        """Start the snapshot of ``step`` on every stateful rank (nothing is waited for).

        One ``take_snapshot`` and one ``publish_snapshot`` per process (its colocated stateful
        roles together) and one ``hold_snapshot`` per holding process (every copy it keeps of
        this step)."""
        if not self._predecessors_removed:
            self._predecessors_removed = True
            self._on_every_node(remove_predecessors, wait=False)
        groups = dict(roles.checkpoint_groups())
        places = roles.role_processes()
        ranks = [(role, r) for role, g in groups.items() for r in range(g.world_size)]
        ring = ring_holders([places.get(key, (None, None)) for key in ranks])
        sizes = {role: g.world_size for role, g in groups.items()}
        by_process = processes(ranks, places)
        process_of = {key: pkey for pkey, members in by_process.items() for key in members}
        self._taken += 1
        snap_id = f"{step}.{self._taken}"
        node = {pkey: self.node_dir is not None and self.use_node_memory and pkey not in self.no_node
                for pkey in by_process}
        holders: dict[str, list] = {role: [] for role in groups}
        # holding process -> (its (role, rank) that is called, {owner process: owners kept})
        kept: dict[Any, tuple[tuple[str, int], dict[Any, list[tuple[str, int]]]]] = {}
        for i, (role, r) in enumerate(ranks):
            holder = ranks[ring[i]]
            owner = places.get((role, r), (None, None))
            if not self.peer_adds_a_copy(owner, places.get(holder, (None, None)), node[process_of[(role, r)]]):
                holders[role].append(None)
                continue
            holders[role].append(holder)
            _, by_owner = kept.setdefault(process_key(holder, places), (holder, {}))
            by_owner.setdefault(process_of[(role, r)], []).append((role, r))
        held = {pkey for _, by_owner in kept.values() for pkey in by_owner}
        takes: dict[str, list] = {role: [None] * g.world_size for role, g in groups.items()}
        done: dict[str, list] = {role: [None] * g.world_size for role, g in groups.items()}
        nodes: dict[str, list] = {role: [None] * g.world_size for role, g in groups.items()}
        published, sealed = [], []
        caller: dict[int, Any] = {}
        for pkey, members in by_process.items():
            (role0, r0), here = members[0], [role for role, _ in members]
            where = {"dir": self.node_dir, "id": snap_id, "owner": self.owner} if node[pkey] else None
            answer = groups[role0].execute_rank_async(r0, "take_snapshot", step, here, where)
            # The checksum (and the commit in node memory) on the process's "snapshot" thread.
            sealed.append(groups[role0].execute_rank_async(r0, "seal_snapshot", step, here, self.timeout_s))
            caller[id(answer)] = caller[id(sealed[-1])] = pkey
            copies = None
            # The object store's copy: the way to a peer on another node, or the copy that
            # outlives the process where node memory does not.
            if pkey in held or not node[pkey]:
                stored, copies = groups[role0].execute_rank_async(r0, "publish_snapshot", step, here, self.timeout_s)
                published.append(stored)
                caller[id(stored)] = pkey
            for role, r in members:
                takes[role][r], done[role][r] = copies, answer
                nodes[role][r] = NodeCopy(self.node_dir, snap_id) if node[pkey] else None
        holds = []
        for (h_role, h_rank), by_owner in kept.values():
            owners = list(by_owner.values())
            refs = [takes[o[0][0]][o[0][1]] for o in owners]
            # The takes go as references (not arguments Ray waits for before sending the call):
            # see hold_snapshot.
            ref = groups[h_role].execute_rank_async(h_rank, "hold_snapshot", step, owners, refs, self.timeout_s)
            holds.append((ref, [key for o in owners for key in o]))
            caller[id(ref)] = process_of.get((h_role, h_rank))
        snap = Snapshot(step, copy.deepcopy(trainer_state), sizes, takes, done, published, holds, holders, nodes,
                        process_of, sealed, caller)
        self._record(step, snapshot_carry.entry(step, snap_id, self.node_dir, sizes, trainer_state)
                     if all(node.values()) else None)  # every copy outlives its process
        self.snapshots = [s for s in self.snapshots if s.step < step] + [snap]
        self._prune()
        return snap

    def _record(self, step: int, new: dict | None) -> None:
        """Record for a later controller the snapshots each rank's ring in node memory holds after
        the take of ``step``: that one (``new``; None where some copy is not in node memory) and
        the takes before it, :data:`KEEP` in all (the take of ``step`` wrote over the oldest)."""
        if self.record_path is None:
            return
        older = [e for e in self._recorded if e["step"] < step][:KEEP - 1]
        self._recorded = ([new] if new is not None else []) + older
        snapshot_carry.write(self.record_path, self._recorded)

    def peer_adds_a_copy(self, owner: tuple[Any, Any], holder: tuple[Any, Any], node_copy: bool = False) -> bool:
        """Whether a ring peer at ``holder`` keeping the copy of the rank at ``owner`` (each its
        (pid, node), None where unknown) adds a copy that survives what the others do not. Not in
        the owner's own process; and not on the owner's node where the owner's copy already
        outlives its process there: in node memory (``node_copy``), or in the object store while
        its copy is read (a holder there would keep a view of that same object-store memory: Ray
        hands a process of the node the node's copy), lost with the same node."""
        (o_pid, o_node), (h_pid, h_node) = owner, holder
        if o_pid is not None and o_pid == h_pid:
            return False
        if o_node is None or h_node is None or o_node != h_node:
            return True
        return not (self.object_store_ok or node_copy)

    def _prune(self) -> None:
        """Keep the newest complete snapshot and the ones after it (at most :data:`MAX_KEPT`)."""
        for s in self.snapshots:
            self.is_complete(s)
        complete = [i for i, s in enumerate(self.snapshots) if s.complete]
        start = complete[-1] if complete else 0
        kept = [s for s in self.snapshots[start:] if not s.failed]
        self.snapshots = kept[-MAX_KEPT:]

    def is_complete(self, snap: Snapshot) -> bool:
        """Whether every take, publish and hold of ``snap`` finished without an error (does not
        wait). Once every answer is in, one that failed makes the snapshot ``failed``, unless each
        failed answer is of a process that died: it is then ``unfinished`` (see :meth:`restore`)."""
        if snap.complete or snap.failed or snap.unfinished:
            return snap.complete
        answers, refs = snap.answers()
        ready, _ = self._wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        if len(ready) < len(refs):
            return False
        try:
            # Small answers: whether every copy is done and kept, without fetching any copy.
            done = {id(r): a for r, a in zip(answers, self._get(refs, timeout=self.timeout_s))}
        except Exception as exc:  # a rank died during the snapshot, or a call of it failed
            self._sort_out(snap, refs, exc)
            return False
        failed = {(role, r): done[id(ref)].get("node_failed", {}).get(role)
                  for role, refs_of_role in snap.done.items() for r, ref in enumerate(refs_of_role)}
        failed = {key: why for key, why in failed.items() if why and snap.node[key[0]][key[1]] is not None}
        if failed:
            # Those ranks' copies are only in their processes: from the next snapshot on, the
            # object store keeps them instead.
            (role, r), why = next(iter(failed.items()))
            self.no_node |= {snap.process_of[key] for key in failed}
            self.emit("snapshot_unusable", step=snap.step,
                      reason=f"node memory under {self.node_dir} is unusable for {role} rank {r} ({why}); "
                             "copies go to the object store from the next snapshot on")
            snap.failed = True
            return False
        snap.bytes = {role: [int(done[id(ref)]["bytes"][role]) for ref in refs_of_role]
                      for role, refs_of_role in snap.done.items()}
        snap.complete = True
        return True

    # ------------------------------------------------------------------ restore
    def _sort_out(self, snap: Snapshot, refs: list, first: Exception) -> None:
        """``snap`` has a failed answer (``first``): ``unfinished`` where every failed answer is of a
        process that died (a failure striking while it was being taken or sealed), else
        ``failed``."""
        suspects, other = set(), None
        for ref in refs:
            try:
                self._get([ref], timeout=self.timeout_s)
            except RayActorError:
                suspects.add(snap.caller.get(id(ref)))
            except Exception as exc:  # noqa: BLE001 -- a copy that could not be made or kept
                other = exc
        if other is None and suspects and None not in suspects:
            logger.info("snapshot of step %d is unfinished: %d process(es) died while it was taken (%s)",
                        snap.step, len(suspects), first)
            snap.unfinished, snap.suspects = True, suspects
            return
        logger.info("snapshot of step %d is incomplete: %s", snap.step, other or first)
        snap.failed = True

    def _settle(self, snap: Snapshot) -> None:
        """Wait (up to the call timeout) until every answer of ``snap`` is in, successful or not:
        the survivors' seals may still be running when a failure strikes."""
        _, refs = snap.answers()
        self._wait(refs, num_returns=len(refs), timeout=self.timeout_s, fetch_local=False)

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (the run went back to ``step``)."""
        self.snapshots = [s for s in self.snapshots if s.step <= step]
        self._recorded = [e for e in self._recorded if e["step"] <= step]
        if self.record_path is not None:
            snapshot_carry.forget_after(self.record_path, step)

    def adopt(self, newest_committed: int | None) -> bool:
        """Take over the snapshots an earlier controller of the run recorded, those newer than
        ``newest_committed`` (:mod:`resilient_rl.workers.snapshots.carry`): the next restore tries
        them first, newest first. Whether there was one."""
        entries = snapshot_carry.adopt(self.record_path, newest_committed) if self.record_path else []
        carried = []
        for e in reversed(entries):  # oldest first, as self.snapshots
            sizes = {role: int(n) for role, n in e["world_sizes"].items()}
            none = {role: [None] * n for role, n in sizes.items()}
            carried.append(Snapshot(e["step"], e["trainer_state"], sizes, takes=dict(none), done={}, published=[],
                                    holds=[], holders=dict(none), node=snapshot_carry.node_copies(e), process_of={},
                                    complete=True, carried=True))
        if carried:
            self.snapshots = [s for s in self.snapshots if s.step < carried[0].step] + carried
        return bool(carried)

    def hand_over_after(self, committed: int | None) -> int | None:
        """Leave this run's node memory to the next controller at :meth:`close` where the record
        names a snapshot newer than ``committed`` (None: no commit); that snapshot's step, or None
        (nothing is left then)."""
        newer = [e["step"] for e in self._recorded if committed is None or e["step"] > committed]
        if self.record_path is None or not newer:
            return None
        self.hand_over = True
        return newer[0]

    def newest_complete(self, min_step: int | None, world_sizes: dict[str, int]) -> list[Snapshot]:
        """Snapshots to try for a restore, newest first: the complete ones and the unfinished ones
        (:attr:`Snapshot.unfinished`), once the answers still in flight are in."""
        out = []
        for s in reversed(self.snapshots):
            if min_step is not None and s.step < min_step:
                break
            if not self.is_complete(s) and not (s.failed or s.unfinished):
                self._settle(s)
            if not (self.is_complete(s) or s.unfinished):
                continue
            if s.world_sizes != world_sizes:
                self.emit("snapshot_unusable", step=s.step,
                          reason=f"taken at world sizes {s.world_sizes}, now {world_sizes}")
                continue
            out.append(s)
        return out

    def restore(self, roles, min_step: int | None) -> Snapshot | None:
        """Load the newest usable snapshot into every stateful rank; None when there is none (the
        caller then restores from storage). A snapshot that fails half way may leave some ranks
        loaded (:attr:`partial`): the caller rebuilds the models before falling back."""
        self.partial = False
        groups = roles.checkpoint_groups()
        world_sizes = {role: g.world_size for role, g in groups}
        for snap in self.newest_complete(min_step, world_sizes):
            t0 = self.clock()
            if snap.carried and not self.loader.all_on_their_nodes(groups, snap):
                snap.failed = True
                continue
            self.partial = True  # from here on, some ranks may hold part of a snapshot
            sources = self.loader.load(groups, snap)
            if sources is None:
                snap.failed = True
                continue
            counts: dict[str, int] = {}
            for src in sources.values():
                counts[src] = counts.get(src, 0) + 1
            self.drop_after(snap.step)
            self.emit("snapshot_restored", step=snap.step, duration_s=self.clock() - t0, sources=counts)
            self.partial = False
            return snap
        return None

    def close(self) -> None:
        """Remove this run's node memory on every live node (at the end of the run), unless it is
        handed over to the next controller (:attr:`hand_over`)."""
        if self.node_dir is not None and not self.hand_over:
            self._on_every_node(remove_run, wait=True)

    def _on_every_node(self, fn: Callable[[str], Any], wait: bool) -> None:
        """Run ``fn(self.node_dir)`` on every live node (:func:`~resilient_rl.runtime.cluster.on_every_node`);
        ``wait``: until done (at most 30 s)."""
        try:
            on_every_node(fn, self.node_dir, wait_s=30.0 if wait else None)
        except Exception as exc:  # a node that went away meanwhile: its memory went with it
            logger.warning("cleaning snapshot node memory %s: %s", self.node_dir, exc)

    def memory(self) -> dict[str, list[int]]:
        """Bytes of one copy per role and rank, from the newest complete snapshot."""
        for s in reversed(self.snapshots):
            if s.complete:
                return dict(s.bytes)
        return {}
