"""A run's newest snapshot handed from one controller to the next: a preemption with no warning
loses no completed step where the job comes back on the same nodes.

A scheduler that takes the machine back with no early signal (Slurm's preemption or
``scontrol requeue``, which signal every process of the job at once; a pod killed with its node's
processes) takes Ray and the workers down with the controller: no checkpoint of the steps after
the last commit can be written any more. What outlives them is node memory: each rank's copy of
the newest snapshot (:mod:`resilient_rl.workers.snapshots.node_memory`), committed there by its take
before the next step starts, and the run folder.

So at each snapshot the keeper records in the run folder (:data:`RECORD`, written atomically)
what a next controller needs to find it: its step, its id, the node-memory directory, the world
sizes and the controller's state of that step (step, data position, KL coefficient, failure
budget). The record names the newest :data:`~resilient_rl.workers.snapshots.slots.KEEP` snapshots,
newest first: each rank's ring of that many slots in node memory holds exactly those, and a
preemption that strikes while the newest is being taken (its copies half written) still finds the
one before it whole. A controller resuming the run (``checkpoint.resume=auto``) whose newest
committed checkpoint is older adopts those newer than the commit (:func:`adopt`) and tries them,
newest first, before the checkpoint: every rank first checks that its copy is in its node's memory
(its new process may run on another node), and only when all are is any loaded; otherwise the next
one is tried, and at last the checkpoint, replaying the steps after it. A roll-back past a recorded
step (a recovery, a NaN) withdraws that entry (:func:`forget_after`): a later controller never
adopts an abandoned timeline.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from resilient_rl.workers.snapshots.node_memory import NodeCopy

logger = logging.getLogger(__name__)

#: The record's file name in the run folder.
RECORD = "snapshot.json"
#: Format 2 names several snapshots (``{"format": 2, "snapshots": [entry, ...]}``, newest first);
#: format 1, one (the entry's fields at the top level).
FORMAT = 2
_ENTRY_FIELDS = {"step": int, "id": str, "node_dir": str, "world_sizes": dict, "trainer_state": dict}


def entry(step: int, snap_id: str, node_dir: str, world_sizes: dict[str, int], trainer_state: dict) -> dict[str, Any]:
    """One recorded snapshot: ``snap_id`` of ``step``, its copies under ``node_dir``."""
    return {"step": step, "id": snap_id, "node_dir": node_dir, "world_sizes": dict(world_sizes),
            "trainer_state": trainer_state}


def write(path: str, entries: list[dict[str, Any]]) -> None:
    """Record ``entries`` (newest first; a temporary file, renamed over the last record)."""
    data = json.dumps({"format": FORMAT, "snapshots": entries}, sort_keys=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:  # the run folder is written by every step: its own errors stop the run there
        logger.warning("could not record the snapshot of step %s in %s: %s",
                       entries[0]["step"] if entries else "-", path, exc)


def _valid(e: Any) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in _ENTRY_FIELDS.items())
            and e["trainer_state"].get("step") == e["step"])


def read(path: str) -> list[dict[str, Any]]:
    """The snapshots recorded at ``path``, newest first; none where there is no record (or it
    cannot be used: logged)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        logger.warning("snapshot record %s is unreadable, not used: %s", path, exc)
        return []
    fmt = record.get("format") if isinstance(record, dict) else None
    entries = [record] if fmt == 1 else record.get("snapshots") if fmt == FORMAT else None
    if not isinstance(entries, list) or not all(_valid(e) for e in entries):
        logger.warning("snapshot record %s is not one this version wrote, not used", path)
        return []
    entries = [{k: e[k] for k in _ENTRY_FIELDS} for e in entries]
    return sorted(entries, key=lambda e: e["step"], reverse=True)


def forget_after(path: str, step: int) -> None:
    """Withdraw the recorded snapshots of steps after ``step`` (the run went back to ``step``)."""
    entries = read(path)
    kept = [e for e in entries if e["step"] <= step]
    if len(kept) == len(entries):
        return
    if kept:
        write(path, kept)
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def adopt(path: str, newest_committed: int | None) -> list[dict[str, Any]]:
    """The recorded snapshots newer than ``newest_committed`` (None: no commit), newest first: what
    :meth:`~resilient_rl.workers.snapshots.keeper.SnapshotKeeper.adopt` builds snapshots from."""
    entries = [e for e in read(path) if newest_committed is None or e["step"] > newest_committed]
    if entries:
        logger.info("the run's snapshot(s) of step(s) %s (newer than its last checkpoint, %s) were left in node "
                    "memory by the previous controller; trying them first, newest first",
                    ", ".join(str(e["step"]) for e in entries),
                    "none" if newest_committed is None else f"step {newest_committed}")
    return entries


def node_copies(e: dict[str, Any]) -> dict[str, list[NodeCopy]]:
    """role -> each rank's copy in node memory, as recorded in entry ``e``."""
    where = NodeCopy(e["node_dir"], e["id"], any_node=True)
    return {role: [where] * int(n) for role, n in e["world_sizes"].items()}
