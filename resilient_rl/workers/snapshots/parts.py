"""The snapshot parts of a stateful role worker (:mod:`resilient_rl.runtime.parts`), declared and
built together: its own copies (:class:`~resilient_rl.workers.snapshots.take.RankSnapshots`),
their loader (:class:`~resilient_rl.workers.snapshots.restore.SnapshotRestorer`) and the copies it
holds for ring peers (:class:`~resilient_rl.workers.snapshots.restore.HeldSnapshots`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable

from resilient_rl.runtime.rank_host import host_of
from resilient_rl.workers.snapshots.restore import HeldSnapshots, SnapshotRestorer
from resilient_rl.workers.snapshots.take import RankSnapshots

#: attribute name -> class, as a worker class declares its parts.
SNAPSHOT_PARTS = MappingProxyType({"snapshots": RankSnapshots, "snapshot_restorer": SnapshotRestorer,
                                   "held_snapshots": HeldSnapshots})


def attach_snapshot_parts(worker: Any, states: Callable[[], Any], place: Callable[[], tuple[int, int]],
                          checkpointer) -> None:
    """Give ``worker`` (a rank of the role ``worker.role``) its snapshot parts, as the attributes
    :data:`SNAPSHOT_PARTS` names. ``states()``: the rank's
    :class:`~resilient_rl.workers.rank_state.RankState` now; ``place()``: its (rank, world size)
    now; ``checkpointer``: its :class:`~resilient_rl.workers.checkpointing.RankCheckpointer` (a
    load resets and re-prepares its staging). The parts find the other roles of the process
    through its :class:`~resilient_rl.runtime.rank_host.RankHost`."""
    def process(attr: str) -> dict[str, Any]:
        return host_of(worker).parts(attr)

    worker.snapshots = RankSnapshots(worker.role, states, place, process)
    worker.snapshot_restorer = SnapshotRestorer(worker.snapshots, checkpointer)
    worker.held_snapshots = HeldSnapshots(worker.role, process)
