"""Process-wide state of a worker's snapshots, shared by the take side
(:mod:`resilient_rl.workers.snapshot`) and the restore side
(:mod:`resilient_rl.workers.snapshot_restore`): which worker hosts each role in this process
(colocated roles share a process), and the locks across the call thread and the "snapshot" thread.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

#: Snapshot steps a rank keeps of its own and of each neighbour it holds for (the newest complete
#: one and the one in flight).
KEEP = 2


PROCESS_ROLES: dict[str, weakref.ref] = {}  # role -> the SnapshotMixin (workers.snapshot) hosting it in this process
HELD_LOCK = threading.Lock()  # the neighbours' copies: kept on the "snapshot" thread, read on the call thread
#: Guards the own copies and the ring slots a publish may still be reading, across the call
#: thread (takes) and the "snapshot" thread (publishes); notified when either changes.
SLOTS = threading.Condition()


def process_role(role: str) -> Any:
    """The worker of ``role`` in this process (colocated roles share one), or None."""
    ref = PROCESS_ROLES.get(role)
    return ref() if ref is not None else None


def process_workers() -> list[Any]:
    return [w for w in (r() for r in list(PROCESS_ROLES.values())) if w is not None]


def previous_publishes_stored() -> None:
    """Called as a call starts on the "snapshot" thread. The thread runs one call at a time and Ray
    stores a call's return before it starts the next, so no ring slot is read by a publish any more."""
    with SLOTS:
        for worker in process_workers():
            worker._publishing = frozenset()
        SLOTS.notify_all()
