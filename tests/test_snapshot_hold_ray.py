"""A ring peer keeping a neighbour's snapshot copy must not hold back its other calls: the copy
arrives as a reference fetched on the "snapshot" thread, so a neighbour stopped before its copy
is done leaves the peer's health and step calls answering (they were queued behind the hold
while Ray resolved its arguments, and a healthy peer was judged unresponsive)."""

from __future__ import annotations

import time

import pytest
import ray

from resilient_rl.runtime.health import HEALTH_GROUPS
from resilient_rl.runtime.worker import RankWorker
from resilient_rl.runtime.parts import routes
from resilient_rl.workers.snapshots.parts import SNAPSHOT_PARTS, attach_snapshot_parts

pytestmark = pytest.mark.ray


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class Holder(RankWorker):
    """A process holding ring peers' copies, with the snapshot parts of a stateful role."""

    answers_during_calls = True
    role = "actor"
    parts = SNAPSHOT_PARTS

    def __init__(self):
        super().__init__()
        attach_snapshot_parts(self, lambda: None, lambda: (self.rank, self.world_size), None)

    @ray.method(concurrency_group="health")
    def health(self):
        return self.ping()


def part_call(handle, name: str, *args):
    """``name`` of a part of Holder, sent as a worker group sends it (runtime/parts.py)."""
    path, options = routes(Holder.__ray_actor_class__)[name]
    return handle.call_part.options(**options).remote(path, *args)


@ray.remote(num_cpus=0)
def unfinished_take(seconds: float) -> dict:
    """A neighbour's take_snapshot that is not done (its process stopped)."""
    time.sleep(seconds)
    return {"step": 1, "rank": 0, "roles": {}}


def test_a_hold_waiting_for_its_neighbour_leaves_health_and_step_calls_answering(ray_cluster):
    holder = Holder.remote()
    pending = unfinished_take.remote(60)
    try:
        assert ray.get(holder.ping.remote(), timeout=60).rank == 0
        hold = part_call(holder, "hold_snapshot", 1, [[("actor", 1)]], [pending], 60.0)
        # Sent after the hold, from the same caller: both answer while the hold still waits.
        assert ray.get(holder.health.remote(), timeout=20).pid > 0
        assert ray.get(part_call(holder, "snapshot_memory"), timeout=20) == {"own_bytes": 0, "held_bytes": 0}
        assert not ray.wait([hold], timeout=0)[0], "the hold cannot be done: its copy is not"
    finally:
        ray.cancel(pending, force=True)
        ray.kill(holder, no_restart=True)
