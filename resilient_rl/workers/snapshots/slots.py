"""The locks of a process's snapshots, shared by the take side
(:mod:`resilient_rl.workers.snapshots.take`) and the restore side
(:mod:`resilient_rl.workers.snapshots.restore`) across the call thread and the "snapshot" thread.
The snapshot parts of each role of the process are its :class:`~resilient_rl.runtime.rank_host.RankHost`'s.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

#: Snapshot steps a rank keeps of its own and of each neighbour it holds for (the newest complete
#: one and the one in flight).
KEEP = 2


HELD_LOCK = threading.Lock()  # the neighbours' copies: kept on the "snapshot" thread, read on the call thread
#: Guards the own copies and the ring slots a publish may still be reading, across the call
#: thread (takes) and the "snapshot" thread (publishes); notified when either changes.
SLOTS = threading.Condition()


def previous_publishes_stored(snapshots: Iterable[Any]) -> None:
    """Called as a call starts on the "snapshot" thread, with the own ``snapshots``
    (:class:`~resilient_rl.workers.snapshots.take.RankSnapshots`) of the process's roles. The
    thread runs one call at a time and Ray stores a call's return before it starts the next, so no
    ring slot is read by a publish any more."""
    with SLOTS:
        for own in snapshots:
            own.publishing = frozenset()
        SLOTS.notify_all()
