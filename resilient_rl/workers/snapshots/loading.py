"""Loading a snapshot back into the ranks: each rank from the first of its copies that is still
there (its own, its node memory's, the object store's, its ring peer's), checked against its
checksum by the rank before anything is written. The bookkeeping of which snapshots exist and
which to try is :class:`~resilient_rl.workers.snapshots.keeper.SnapshotKeeper`'s.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from resilient_rl.errors import WorkerDiedError, WorkerTimeoutError

logger = logging.getLogger(__name__)

#: What a tier of copies gives for a rank it has no copy of (that rank is not asked to load it).
NO_COPY = object()


class SnapshotLoader:
    """Fills the ranks of a :class:`~resilient_rl.workers.snapshots.tracked.Snapshot`.

    Args:
        timeout_s: the deadline of each load call.
        emit: ``emit(kind, **fields)`` records an event of the run.
        object_store_ok: whether the object store's copies are read (not where Ray could rebuild
            a lost copy by re-running the snapshot, ``recovery.max_task_retries`` > 0).
    """

    def __init__(self, timeout_s: float, emit: Callable[..., None], object_store_ok: bool):
        self.timeout_s, self.emit, self.object_store_ok = timeout_s, emit, object_store_ok

    def load(self, groups, snap) -> dict[tuple[str, int], str] | None:
        """Fill every rank of ``snap``; (role, rank) -> the copy used, or None when some rank's
        copies are all lost (reported as ``snapshot_unusable``). Each tier of copies is asked of
        every rank still to fill, of all roles at once (one round of calls per tier). Of an
        unfinished snapshot, the ranks of the processes that died while it was taken are filled
        first: where one of them has no whole copy left, no other rank was touched."""
        keys = [(role, r) for role, g in groups for r in range(g.world_size)]
        first = [key for key in keys if snap.process_of.get(key) in snap.suspects]
        used: dict[tuple[str, int], str] = {}
        for todo in ([first, [key for key in keys if key not in first]] if first else [keys]):
            if self._fill(groups, snap, todo, used) is None:
                return None
        return used

    def _fill(self, groups, snap, todo: list[tuple[str, int]], used: dict) -> dict | None:
        """Fill the ranks ``todo`` of ``snap`` (see :meth:`load`), adding the copy used to ``used``."""
        by_role = dict(groups)
        sources: list[tuple[str, Callable[[str, int], Any]]] = [
            ("own", lambda role, r: None),
            ("node", lambda role, r: snap.node[role][r] or NO_COPY)]
        if self.object_store_ok:
            sources.append(("object_store", lambda role, r: NO_COPY if snap.takes[role][r] is None
                            else [snap.takes[role][r]]))
        sources.append(("peer", lambda role, r: self._held(by_role, snap, role, r)))
        for name, source in sources:
            if not todo:
                break
            asked = [(key, c) for key, c in ((key, source(*key)) for key in todo) if c is not NO_COPY]
            refs = [by_role[role].execute_rank_async(r, "load_snapshot", snap.step, c, self.timeout_s)
                    for (role, r), c in asked]
            for ((role, r), _), ref in zip(asked, refs):
                answer = self._answers(by_role[role], [ref])[0]
                if answer is True or answer == "unsealed":  # a node copy left unsealed by a dead process
                    used[(role, r)] = name if answer is True else f"{name}_unsealed"
                    todo.remove((role, r))
                elif isinstance(answer, dict) and "corrupt" in answer:
                    # Not restored (the rank checked before writing): its next copy is tried.
                    self.emit("snapshot_corrupt", step=snap.step, role=role, rank=r, source=name,
                              reason=str(answer["corrupt"]))
        if todo:
            role = todo[0][0]
            self.emit("snapshot_unusable", step=snap.step,
                      reason=f"every copy of {role} rank(s) {[r for k, r in todo if k == role]} is lost")
            return None
        return used

    def all_on_their_nodes(self, groups, snap) -> bool:
        """Whether every rank finds its copy of the carried ``snap`` in its node's memory (asked
        before any is loaded: a rank on another node now has none)."""
        asked = [(role, r, g.execute_rank_async(r, "node_copy_here", snap.step, snap.node[role][r]))
                 for role, g in groups for r in range(g.world_size)]
        missing = [(role, r) for role, r, ref in asked if self._answers(dict(groups)[role], [ref])[0] is not True]
        if missing:
            self.emit("snapshot_unusable", step=snap.step,
                      reason=f"the previous controller's snapshot is not in the node memory of {len(missing)} rank(s) "
                             f"(first: {missing[0][0]} rank {missing[0][1]}): they run on other nodes now, or it "
                             f"was removed (its recovery.snapshot_hand_over_s passed, or a live run needed the room)")
        return not missing

    @staticmethod
    def _held(groups: dict, snap, role: str, rank: int):
        """A reference to the peer copy of ``role`` rank ``rank`` (resolved by Ray for the loader),
        :data:`NO_COPY` where no peer keeps one."""
        holder = snap.holders[role][rank]
        if holder is None or holder[0] not in groups:
            return NO_COPY
        h_role, h_rank = holder
        return groups[h_role].execute_rank_async(h_rank, "held_snapshot", snap.step, role, rank)

    def _answers(self, g, refs: list) -> list:
        """Each call's result, or False for a copy that could not be used (it does not match):
        the rank then tries its next copy. A copy lost with its holder is not an error here
        (the loader answers False). A loading rank that died or hung is a failure during
        recovery, raised: the recovery starts over and rebuilds its group, rather than the
        restore going on around a rank Ray restarts empty."""
        out = []
        for ref in refs:
            try:
                out.append(g.get([ref], timeout_s=self.timeout_s + 10.0)[0])
            except (WorkerDiedError, WorkerTimeoutError):
                raise
            except Exception as exc:
                logger.warning("loading a snapshot copy failed: %s", exc)
                out.append(False)
        return out
