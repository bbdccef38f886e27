"""In-memory snapshots in node memory (a tmpfs that outlives the processes) against fake groups:
where it replaces the object store and peers, what an unusable one costs, and the snapshot a
controller leaves there for the next one (workers/snapshots/keeper.py)."""

from __future__ import annotations

import json
import os

from resilient_rl.testing.snapshot_keeper import FakeGroup, FakeRoles, keeper
from resilient_rl.workers.snapshots.slots import KEEP



def test_node_memory_replaces_the_object_store_where_no_peer_is_on_another_node():
    """Every stateful rank on one node, copies in node memory: no publish and no hold is sent,
    and a restarted rank reads the copy its process left in node memory."""
    actor, critic = FakeGroup(2, "actor"), FakeGroup(1, "critic")
    one_node = {(role, r): "n0" for role, n in (("actor", 2), ("critic", 1)) for r in range(n)}
    roles = FakeRoles(actor, critic, nodes=one_node)
    events = []
    k = keeper(events=events, node_dir="/nonexistent-root")
    snap = k.take(roles, 6, {"step": 6})
    assert k.node_dir.startswith("/nonexistent-root/resilient-rl-run-")
    methods = [m for g in (actor, critic) for _, m, _ in g.calls]
    assert "publish_snapshot" not in methods and "hold_snapshot" not in methods
    assert snap.published == [] and snap.takes == {"actor": [None, None], "critic": [None]}
    assert k.is_complete(snap)
    actor.restart(1)
    assert k.restore(roles, None).step == 6
    assert actor.loaded == {0: ("own", "actor0@6"), 1: ("node", "actor1@6")}
    assert events[-1][1]["sources"] == {"own": 2, "node": 1}
    # Restarted on another node: no copy is left (the object store never had one).
    actor.restart(1)
    actor.node_lost = {1}
    assert k.restore(roles, None) is None
    assert events[-1][0] == "snapshot_unusable" and "actor rank(s) [1]" in events[-1][1]["reason"]


def test_node_memory_publishes_for_a_peer_on_another_node():
    actor, critic = FakeGroup(2, "actor"), FakeGroup(1, "critic")
    roles = FakeRoles(actor, critic, nodes={("actor", 0): "a", ("actor", 1): "a", ("critic", 0): "b"})
    k = keeper(node_dir="/nonexistent-root")
    snap = k.take(roles, 7, {"step": 7})
    # Actor ranks (node a) are held by the critic on node b: their copies travel through the
    # object store; the critic's holder is actor 0 on node a: published too.
    assert snap.holders == {"actor": [("critic", 0), ("critic", 0)], "critic": [("actor", 0)]}
    assert len(snap.published) == 3 and all(t is not None for ts in snap.takes.values() for t in ts)
    assert k.is_complete(snap)
    # Node a is lost: the actor ranks restart elsewhere and read the peer's copies.
    for r in (0, 1):
        actor.restart(r)
    actor.node_lost = actor.store_lost = {0, 1}
    assert k.restore(roles, None).step == 7
    assert actor.loaded == {0: ("peer", "actor0@7"), 1: ("peer", "actor1@7")}


def test_same_node_peer_not_asked_where_node_memory_keeps_the_copy():
    g = FakeGroup(2)
    k = keeper(max_task_retries=1, node_dir="/nonexistent-root")
    snap = k.take(FakeRoles(g, nodes={("actor", 0): "n0", ("actor", 1): "n0"}), 5, {"step": 5})
    assert snap.holders == {"actor": [None, None]} and snap.holds == []


def test_unusable_node_memory_fails_that_snapshot_then_publishes():
    g = FakeGroup(2)
    roles = FakeRoles(g, nodes={("actor", 0): "n0", ("actor", 1): "n0"})
    events = []
    k = keeper(events=events, node_dir="/nonexistent-root")
    g.node_error = {1}
    first = k.take(roles, 1, {"step": 1})
    assert not k.is_complete(first) and first.failed
    assert events[-1][0] == "snapshot_unusable" and "actor rank 1" in events[-1][1]["reason"]
    assert "No space left" in events[-1][1]["reason"]
    second = k.take(roles, 2, {"step": 2})
    # Rank 1's process now publishes (its take no longer names a node directory); rank 0 does not.
    takes = [(r, a[2]) for r, m, a in g.calls if m == "take_snapshot" and a[0] == 2]
    assert takes == [(0, {"dir": k.node_dir, "id": "2.2", "owner": k.owner}), (1, None)]
    assert second.takes["actor"][0] is None and second.takes["actor"][1] is not None
    assert k.is_complete(second)
    g.restart(0)
    g.restart(1)
    assert k.restore(roles, None).step == 2
    assert g.loaded == {0: ("node", "actor0@2"), 1: ("object_store", "actor1@2")}


def _preempted_run(tmp_path):
    """A controller that took the snapshots of steps 4 and 5 with node memory, then went down with
    its workers (a preemption with no warning): the fake processes start afresh."""
    record = str(tmp_path / "snapshot.json")
    g = FakeGroup(2)
    roles = FakeRoles(g, nodes={("actor", 0): "a", ("actor", 1): "a"})
    first = keeper(node_dir="/nonexistent-root", record_path=record)
    first.take(roles, 4, {"step": 4, "loader": {"epoch": 0, "index": 4}})
    first.take(roles, 5, {"step": 5, "loader": {"epoch": 0, "index": 5}})
    g.restart(0)
    g.restart(1)
    return g, roles, record


def test_the_next_controller_adopts_the_snapshot_its_predecessor_left_in_node_memory(tmp_path):
    g, roles, record = _preempted_run(tmp_path)
    events = []
    k = keeper(events=events, node_dir="/nonexistent-root", record_path=record)
    assert not k.adopt(newest_committed=5)  # not newer than the last commit: the checkpoint is the same step
    assert k.adopt(newest_committed=2)
    snap = k.restore(roles, None)
    assert snap.step == 5 and snap.trainer_state == {"step": 5, "loader": {"epoch": 0, "index": 5}}
    assert g.loaded == {0: ("node", "actor0@5"), 1: ("node", "actor1@5")}
    assert events[-1][0] == "snapshot_restored" and events[-1][1]["sources"] == {"node": 2}


def test_a_carried_snapshot_a_rank_cannot_find_on_its_node_touches_no_rank(tmp_path):
    g, roles, record = _preempted_run(tmp_path)
    g.node_lost = {1}  # rank 1's new process runs on another node
    events = []
    k = keeper(events=events, node_dir="/nonexistent-root", record_path=record)
    assert k.adopt(newest_committed=None)
    assert k.restore(roles, None) is None and not k.partial
    assert not [c for c in g.calls if c[1] == "load_snapshot"] and g.loaded == {}
    assert any(kind == "snapshot_unusable" and "actor rank 1" in f["reason"] for kind, f in events)


def test_a_preemption_during_a_take_continues_from_the_snapshot_before_it(tmp_path):
    """The job was stopped while the take of step 5 was writing its copies: rank 1's is not whole
    (its ring slot of step 5 was being written). The record names step 4 too, whose copies the ring's
    other slot still holds: the next controller loads that one, touching no rank with step 5."""
    g, roles, record = _preempted_run(tmp_path)
    del g.node[1]["5.2"]
    events = []
    k = keeper(events=events, node_dir="/nonexistent-root", record_path=record)
    assert k.adopt(newest_committed=None)
    snap = k.restore(roles, None)
    assert snap.step == 4 and snap.trainer_state == {"step": 4, "loader": {"epoch": 0, "index": 4}}
    assert g.loaded == {0: ("node", "actor0@4"), 1: ("node", "actor1@4")}
    assert not [c for c in g.calls if c[1] == "load_snapshot" and c[2][0] == 5]
    assert [kind for kind, _ in events] == ["snapshot_unusable", "snapshot_restored"]


def test_the_record_names_what_the_rings_hold(tmp_path):
    """Each rank's ring holds the newest KEEP takes: the record names those, newest first, and a
    roll-back withdraws only the entries after its step. A record of the previous format (one
    snapshot) is still adopted."""
    from resilient_rl.workers.snapshots import carry as snapshot_carry

    record = str(tmp_path / "snapshot.json")
    g = FakeGroup(2)
    roles = FakeRoles(g, nodes={("actor", 0): "a", ("actor", 1): "a"})
    k = keeper(node_dir="/nonexistent-root", record_path=record)
    for step in (4, 5, 6):
        k.take(roles, step, {"step": step})
    assert [e["step"] for e in snapshot_carry.read(record)] == [6, 5][:KEEP]
    k.drop_after(5)
    assert [e["step"] for e in snapshot_carry.read(record)] == [5]
    k.take(roles, 6, {"step": 6})
    assert [e["step"] for e in snapshot_carry.read(record)] == [6, 5][:KEEP]
    old = dict(snapshot_carry.read(record)[0], format=1)
    with open(record, "w") as f:
        json.dump(old, f)
    assert [e["step"] for e in snapshot_carry.adopt(record, newest_committed=5)] == [6]


def test_node_memory_is_handed_over_only_with_a_snapshot_newer_than_the_commit(tmp_path):
    record = str(tmp_path / "snapshot.json")
    g = FakeGroup(2)
    roles = FakeRoles(g, nodes={("actor", 0): "a", ("actor", 1): "a"})
    k = keeper(node_dir="/nonexistent-root", record_path=record)
    assert k.hand_over_after(None) is None and not k.hand_over  # nothing recorded yet
    k.take(roles, 4, {"step": 4})
    k.take(roles, 5, {"step": 5})
    assert k.hand_over_after(5) is None and not k.hand_over
    assert k.hand_over_after(4) == 5 and k.hand_over
    assert keeper(node_dir="/nonexistent-root").hand_over_after(None) is None  # no record kept


def test_a_roll_back_past_the_recorded_step_withdraws_the_record(tmp_path):
    g, roles, record = _preempted_run(tmp_path)
    k = keeper(node_dir="/nonexistent-root", record_path=record)
    k.drop_after(5)
    assert os.path.exists(record)
    k.drop_after(3)  # a recovery or a NaN took the run back to step 3: step 5 is another timeline's
    assert not os.path.exists(record) and not k.adopt(newest_committed=None)
    with open(record, "w") as f:
        f.write("{not json")
    assert not k.adopt(newest_committed=None)  # unreadable: not used (logged)


def test_a_carried_snapshot_of_other_world_sizes_is_not_loaded(tmp_path):
    """The run resumes on another number of ranks (elastic resume): snapshots are never resharded,
    so the checkpoint is used and no rank is asked for the carried copy."""
    g, roles, record = _preempted_run(tmp_path)
    events = []
    k = keeper(events=events, node_dir="/nonexistent-root", record_path=record)
    assert k.adopt(newest_committed=None)
    assert k.restore(FakeRoles(FakeGroup(4)), None) is None
    assert not [c for c in g.calls if c[1] in ("node_copy_here", "load_snapshot")]
    assert any(kind == "snapshot_unusable" and "world sizes" in f["reason"] for kind, f in events)
