"""A run's newest snapshot handed from one controller to the next: a preemption with no warning
loses no completed step where the job comes back on the same nodes.

A scheduler that takes the machine back with no early signal (Slurm's preemption or
``scontrol requeue``, which signal every process of the job at once; a pod killed with its node's
processes) takes Ray and the workers down with the controller: no checkpoint of the steps after
the last commit can be written any more. What outlives them is node memory: each rank's copy of
the newest snapshot (:mod:`resilient_rl.workers.node_memory`), committed there by its take
before the next step starts, and the run folder.

So at each snapshot the keeper records in the run folder (:data:`RECORD`, written atomically)
what a next controller needs to find it: its step, its id, the node-memory directory, the world
sizes and the controller's state of that step (step, data position, KL coefficient, failure
budget). A controller resuming the run (``checkpoint.resume=auto``) whose newest committed
checkpoint is older adopts that snapshot (:func:`adopt`) and tries it before the checkpoint:
every rank first checks that its copy is in its node's memory (its new process may run on another
node), and only when all are is any loaded; otherwise the run resumes from the checkpoint and
replays those steps, as without. A roll-back past the recorded step (a recovery, a NaN)
withdraws the record (:func:`forget_after`): a later controller never adopts an abandoned
timeline.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from resilient_rl.workers.node_memory import NodeCopy

logger = logging.getLogger(__name__)

#: The record's file name in the run folder.
RECORD = "snapshot.json"
FORMAT = 1


def write(path: str, step: int, snap_id: str, node_dir: str, world_sizes: dict[str, int],
          trainer_state: dict) -> None:
    """Record the snapshot ``snap_id`` of ``step`` (temporary file, renamed over the last)."""
    data = json.dumps({"format": FORMAT, "step": step, "id": snap_id, "node_dir": node_dir,
                       "world_sizes": world_sizes, "trainer_state": trainer_state}, sort_keys=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:  # the run folder is written by every step: its own errors stop the run there
        logger.warning("could not record the snapshot of step %d in %s: %s", step, path, exc)


def read(path: str) -> dict[str, Any] | None:
    """The record at ``path``, or None where there is none (or it cannot be used: logged)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("snapshot record %s is unreadable, not used: %s", path, exc)
        return None
    ok = (isinstance(record, dict) and record.get("format") == FORMAT and isinstance(record.get("step"), int)
          and isinstance(record.get("id"), str) and isinstance(record.get("node_dir"), str)
          and isinstance(record.get("world_sizes"), dict) and isinstance(record.get("trainer_state"), dict)
          and record["trainer_state"].get("step") == record["step"])
    if not ok:
        logger.warning("snapshot record %s is not one this version wrote, not used", path)
        return None
    return record


def forget_after(path: str, step: int) -> None:
    """Withdraw the record where it names a step after ``step`` (the run went back to ``step``)."""
    record = read(path)
    if record is not None and record["step"] > step:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def adopt(path: str, newest_committed: int | None) -> dict[str, Any] | None:
    """The recorded snapshot, where it is newer than ``newest_committed`` (None: no commit): what
    :meth:`~resilient_rl.recovery.snapshots.SnapshotKeeper.adopt` builds a snapshot from."""
    record = read(path)
    if record is None or (newest_committed is not None and record["step"] <= newest_committed):
        return None
    logger.info("the run's snapshot of step %d (newer than its last checkpoint, %s) was left in node memory "
                "by the previous controller; trying it first", record["step"],
                "none" if newest_committed is None else f"step {newest_committed}")
    return record


def node_copies(record: dict[str, Any]) -> dict[str, list[NodeCopy]]:
    """role -> each rank's copy in node memory, as recorded."""
    where = NodeCopy(record["node_dir"], record["id"], any_node=True)
    return {role: [where] * int(n) for role, n in record["world_sizes"].items()}
