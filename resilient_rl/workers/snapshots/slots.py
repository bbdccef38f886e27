"""The locks of a process's snapshots, shared by the take side
(:mod:`resilient_rl.workers.snapshots.take`) and the restore side
(:mod:`resilient_rl.workers.snapshots.restore`) across the call thread and the "snapshot" thread.
Which worker hosts each role of the process is its :class:`~resilient_rl.runtime.rank_host.RankHost`'s.
"""

from __future__ import annotations

import threading
from typing import Any

#: Snapshot steps a rank keeps of its own and of each neighbour it holds for (the newest complete
#: one and the one in flight).
KEEP = 2


HELD_LOCK = threading.Lock()  # the neighbours' copies: kept on the "snapshot" thread, read on the call thread
#: Guards the own copies and the ring slots a publish may still be reading, across the call
#: thread (takes) and the "snapshot" thread (publishes); notified when either changes.
SLOTS = threading.Condition()


def previous_publishes_stored(workers: list[Any]) -> None:
    """Called as a call starts on the "snapshot" thread, with the process's role ``workers``. The
    thread runs one call at a time and Ray stores a call's return before it starts the next, so no
    ring slot is read by a publish any more."""
    with SLOTS:
        for worker in workers:
            worker._publishing = frozenset()
        SLOTS.notify_all()
