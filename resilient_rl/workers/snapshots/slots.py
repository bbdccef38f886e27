"""What the take side (:mod:`resilient_rl.workers.snapshots.take`) and the restore side
(:mod:`resilient_rl.workers.snapshots.restore`) of a process's snapshots share: how many copies
a rank keeps, and the start of a call on the "snapshot" thread. Each part guards its own state
with its own lock; the snapshot parts of each role of the process are its
:class:`~resilient_rl.runtime.rank_host.RankHost`'s.
"""

from __future__ import annotations

from typing import Any, Iterable

#: Snapshot steps a rank keeps of its own and of each neighbour it holds for (the newest complete
#: one and the one in flight).
KEEP = 2


def previous_publishes_stored(snapshots: Iterable[Any]) -> None:
    """Called as a call starts on the "snapshot" thread, with the own ``snapshots``
    (:class:`~resilient_rl.workers.snapshots.take.RankSnapshots`) of the process's roles. The
    thread runs one call at a time and Ray stores a call's return before it starts the next, so no
    ring slot is read by a publish any more."""
    for own in snapshots:
        with own.slots:
            own.publishing = frozenset()
            own.slots.notify_all()
