"""The snapshot parts of a stateful role worker (:mod:`resilient_rl.runtime.parts`), declared and
built together: its own copies (:class:`~resilient_rl.workers.snapshots.take.RankSnapshots`),
their loader (:class:`~resilient_rl.workers.snapshots.restore.SnapshotRestorer`) and the copies it
holds for ring peers (:class:`~resilient_rl.workers.snapshots.restore.HeldSnapshots`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable

from resilient_rl.workers.snapshots.restore import HeldSnapshots, SnapshotRestorer
from resilient_rl.workers.snapshots.take import RankSnapshots

#: attribute name -> class, as a worker class declares its parts.
SNAPSHOT_PARTS = MappingProxyType({"snapshots": RankSnapshots, "snapshot_restorer": SnapshotRestorer,
                                   "held_snapshots": HeldSnapshots})


def snapshot_parts(role: str, states: Callable[[], Any], place: Callable[[], tuple[int, int]], checkpointer,
                   process: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The snapshot parts of ``role``'s rank, by attribute name. ``states()``: the rank's
    :class:`~resilient_rl.workers.rank_state.RankState` now; ``place()``: its (rank, world size)
    now; ``checkpointer``: its :class:`~resilient_rl.workers.checkpointing.RankCheckpointer` (a
    load resets and re-prepares its staging); ``process(attr)``: the part ``attr`` of every role
    in this process, by role (:meth:`~resilient_rl.runtime.rank_host.RankHost.parts`)."""
    snapshots = RankSnapshots(role, states, place, process)
    return {"snapshots": snapshots, "snapshot_restorer": SnapshotRestorer(snapshots, checkpointer),
            "held_snapshots": HeldSnapshots(role, process)}
