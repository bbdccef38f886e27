"""Controller-side bookkeeping of in-memory snapshots (workers/snapshots/keeper.py) against fake
groups: the rings, taking, completing and restoring (node memory: tests/test_snapshot_node_memory.py)."""

from __future__ import annotations

import pytest

from resilient_rl.errors import WorkerDiedError
from resilient_rl.testing.snapshot_keeper import FakeGroup, FakeRoles, keeper
from resilient_rl.workers.snapshots.ring import ring_holders


def test_ring_holders_prefer_another_node_then_another_process():
    assert ring_holders([(1, "a")]) == [0]
    assert ring_holders([(1, "a"), (2, "a")]) == [1, 0]
    # Ranks on two or more nodes: a ring by node, the j-th rank of a node held by the j-th of the next.
    assert ring_holders([(1, "a"), (2, "a"), (3, "b"), (4, "b")]) == [2, 3, 0, 1]
    assert ring_holders([(1, "a"), (2, "b"), (3, "a"), (4, "b")]) == [1, 0, 3, 2]
    # Colocated actor and critic ranks share a process: the peer is another process.
    assert ring_holders([(1, "a"), (2, "a"), (1, "a"), (2, "a")]) == [1, 2, 3, 0]


def test_ring_by_node_survives_the_loss_of_any_node_and_spreads_the_copies():
    # A role of 4 ranks per node on 3 nodes, then colocated actor + critic ranks (one process per
    # pair) on 2 nodes of 2: every copy is on another node, and no rank holds more than one
    # copy per role it hosts.
    places = [(100 + r, "abc"[r // 4]) for r in range(12)]
    holders = ring_holders(places)
    assert all(places[h][1] != places[i][1] for i, h in enumerate(holders))
    assert sorted(holders) == list(range(12))
    colocated = [(10, "a"), (11, "a"), (12, "b"), (13, "b")] * 2
    holders = ring_holders(colocated)
    assert all(colocated[h][1] != colocated[i][1] for i, h in enumerate(holders))
    assert holders[:4] == [2, 3, 0, 1] and sorted(holders) == list(range(8))
    # Uneven nodes (a split role of 1 rank next to one of 2): still off node, wrapping around.
    assert ring_holders([(1, "a"), (2, "a"), (3, "b")]) == [2, 2, 0]


def test_peer_copy_held_by_another_role_on_another_node():
    actor, critic = FakeGroup(2, "actor"), FakeGroup(1, "critic")
    roles = FakeRoles(actor, critic, nodes={("actor", 0): "a", ("actor", 1): "a", ("critic", 0): "b"})
    k = keeper()
    snap = k.take(roles, 7, {"step": 7})
    assert snap.holders == {"actor": [("critic", 0), ("critic", 0)], "critic": [("actor", 0)]}
    # Node a is lost: both actor ranks restart and their object-store copies are gone.
    actor.restart(0)
    actor.restart(1)
    actor.store_lost = {0, 1}
    assert k.restore(roles, None).step == 7
    assert actor.loaded == {0: ("peer", "actor0@7"), 1: ("peer", "actor1@7")}
    assert critic.loaded == {0: ("own", "critic0@7")}


def test_due():
    assert [s for s in range(1, 7) if keeper(every=2).due(s)] == [2, 4, 6]
    assert not any(keeper(every=0).due(s) for s in range(1, 7))


def test_complete_only_when_every_hold_finished():
    g = FakeGroup(2)
    k = keeper()
    g.hold_pending = True
    snap = k.take(FakeRoles(g), 3, {"step": 3})
    assert not k.is_complete(snap)
    for r, _ in snap.holds:
        r.ready = True
    assert k.is_complete(snap) and snap.bytes == {"actor": [10, 10]}


def test_failed_take_makes_the_snapshot_unusable_and_restore_uses_the_previous():
    g = FakeGroup(2)
    k = keeper()
    roles = FakeRoles(g)
    k.take(roles, 1, {"step": 1})
    g.take_error = {1}
    bad = k.take(roles, 2, {"step": 2})
    assert not k.is_complete(bad) and bad.failed
    snap = k.restore(roles, min_step=None)
    assert snap.step == 1 and snap.trainer_state == {"step": 1}
    assert g.loaded == {0: ("own", "actor0@1"), 1: ("own", "actor1@1")}


def _one_node_after_step_4(events=None):
    """Two ranks on one node with node memory, the snapshot of step 4 taken."""
    g = FakeGroup(2)
    k = keeper(events=events, node_dir="/nonexistent-root")
    roles = FakeRoles(g, nodes={("actor", 0): "a", ("actor", 1): "a"})
    k.take(roles, 4, {"step": 4})
    return g, k, roles


def test_a_process_dead_before_its_seal_leaves_a_snapshot_its_node_copy_restores():
    """The failure struck after rank 1's take of step 5 and before its seal: the snapshot is
    unfinished, and rank 1's new process loads the copy it left in node memory, unsealed; rank 0
    its own. Step 5 is restored, not step 4: nothing is replayed."""
    events = []
    g, k, roles = _one_node_after_step_4(events)
    g.died_sealing = {1}
    snap = k.take(roles, 5, {"step": 5})
    assert not k.is_complete(snap) and snap.unfinished and not snap.failed
    g.restart(1)
    assert k.restore(roles, None).step == 5
    assert g.loaded == {0: ("own", "actor0@5"), 1: ("node", "actor1@5")}
    assert events[-1] == ("snapshot_restored", {"step": 5, "duration_s": pytest.approx(0, abs=60),
                                                "sources": {"node_unsealed": 1, "own": 1}})


def test_survivors_seals_in_flight_are_waited_for_before_choosing_a_snapshot():
    g, k, roles = _one_node_after_step_4()
    g.seal_pending = True
    k.take(roles, 5, {"step": 5})
    g.restart(1)
    assert k.restore(roles, None).step == 5
    assert g.loaded == {0: ("own", "actor0@5"), 1: ("node", "actor1@5")}


def test_a_process_dead_during_its_take_leaves_no_copy_and_the_survivors_are_not_touched():
    """Rank 1 died before its copy of step 5 was made: step 4 is restored, and rank 0 was never
    asked to load step 5 (the dead process's ranks are filled first)."""
    events = []
    g, k, roles = _one_node_after_step_4(events)
    g.died_taking = {1}
    k.take(roles, 5, {"step": 5})
    g.restart(1)
    g.died_taking = set()
    assert k.restore(roles, None).step == 4
    assert g.loaded == {0: ("own", "actor0@4"), 1: ("node", "actor1@4")}
    assert not [c for c in g.calls if c[0] == 0 and c[1] == "load_snapshot" and c[2][0] == 5]
    assert any(kind == "snapshot_unusable" and f["step"] == 5 for kind, f in events)


def test_keeps_newest_complete_and_in_flight_only():
    g = FakeGroup(1)
    k = keeper()
    roles = FakeRoles(g)
    for step in (1, 2, 3):
        k.take(roles, step, {"step": step})
    assert [s.step for s in k.snapshots] == [3]
    g.take_pending = True
    k.take(roles, 4, {"step": 4})
    assert [s.step for s in k.snapshots] == [3, 4]


def test_restarted_rank_reads_the_object_store_then_the_peer():
    g = FakeGroup(2)
    events = []
    k = keeper(events=events)
    roles = FakeRoles(g)
    k.take(roles, 5, {"step": 5})
    g.restart(1)
    assert k.restore(roles, min_step=4).step == 5
    assert g.loaded[0] == ("own", "actor0@5") and g.loaded[1] == ("object_store", "actor1@5")
    assert events[-1] == ("snapshot_restored", {"step": 5, "duration_s": pytest.approx(0, abs=5),
                                                "sources": {"own": 1, "object_store": 1}})
    # The node is gone: own copy and object store copy lost, the peer's copy remains.
    g.loaded.clear()
    g.restart(1)
    g.store_lost = {1}
    assert k.restore(roles, min_step=4).step == 5
    assert g.loaded[1] == ("peer", "actor1@5")


def test_a_corrupt_copy_is_reported_and_the_next_source_used_then_storage():
    g = FakeGroup(2)
    events = []
    k = keeper(events=events)
    roles = FakeRoles(g)
    k.take(roles, 5, {"step": 5})
    g.restart(1)
    g.corrupt = {(1, "object_store")}
    assert k.restore(roles, min_step=3).step == 5
    assert g.loaded[1] == ("peer", "actor1@5")
    corrupt = [f for kind, f in events if kind == "snapshot_corrupt"]
    assert corrupt == [{"step": 5, "role": "actor", "rank": 1, "source": "object_store",
                        "reason": "checksum xxh3_64:1 does not match the recorded xxh3_64:0 (object_store)"}]
    # Every copy of rank 1 damaged: none is restored, the caller falls back to storage.
    events.clear()
    g.loaded.clear()
    g.restart(1)
    g.corrupt = {(1, "object_store"), (1, "peer")}
    assert k.restore(roles, min_step=3) is None and k.partial
    assert [f["source"] for kind, f in events if kind == "snapshot_corrupt"] == ["object_store", "peer"]
    assert 1 not in g.loaded


def test_object_store_skipped_when_tasks_are_retried():
    g = FakeGroup(2)
    k = keeper(max_task_retries=1)
    roles = FakeRoles(g)
    k.take(roles, 5, {"step": 5})
    g.restart(1)
    k.restore(roles, None)
    assert g.loaded[1] == ("peer", "actor1@5")
    assert not any(m == "load_snapshot" and isinstance(a[1], list) for _, m, a in g.calls)


def test_a_loading_rank_that_dies_fails_the_restore_so_that_recovery_starts_over():
    """Not a lost copy to fall back from: the rank itself is gone (Ray would restart it empty)."""
    g = FakeGroup(2)
    k = keeper()
    roles = FakeRoles(g)
    k.take(roles, 5, {"step": 5})
    g.dead_loaders = {1}
    with pytest.raises(WorkerDiedError):
        k.restore(roles, None)


def test_owner_and_holder_lost_falls_back():
    g = FakeGroup(2)
    events = []
    k = keeper(events=events)
    roles = FakeRoles(g)
    k.take(roles, 5, {"step": 5})
    g.restart(0)
    g.restart(1)
    g.store_lost = {0, 1}
    assert k.restore(roles, None) is None
    assert k.partial
    assert events[-1][0] == "snapshot_unusable" and "every copy" in events[-1][1]["reason"]


def test_older_than_the_last_checkpoint_or_other_world_size_is_not_used():
    g = FakeGroup(2)
    events = []
    k = keeper(events=events)
    k.take(FakeRoles(g), 5, {"step": 5})
    assert k.restore(FakeRoles(g), min_step=6) is None and not k.partial
    assert k.restore(FakeRoles(FakeGroup(1)), min_step=None) is None
    assert events[-1][0] == "snapshot_unusable" and "world sizes" in events[-1][1]["reason"]


def test_drop_after_forgets_newer_steps():
    g = FakeGroup(1)
    k = keeper()
    g.take_pending = True
    for step in (1, 2, 3):
        k.take(FakeRoles(g), step, {"step": step})
    k.drop_after(2)
    assert [s.step for s in k.snapshots] == [1, 2]


def test_colocated_roles_take_once_per_process_and_hold_once_per_peer():
    actor, critic = FakeGroup(2, "actor"), FakeGroup(2, "critic")
    roles = FakeRoles(actor, critic, colocated=True)
    k = keeper()
    snap = k.take(roles, 4, {"step": 4})
    calls = [(g.role, r, m, a) for g in (actor, critic) for r, m, a in g.calls]
    takes = [c for c in calls if c[2] == "take_snapshot"]
    assert sorted((role, r, a[1]) for role, r, _, a in takes) == [("actor", 0, ["actor", "critic"]),
                                                                 ("actor", 1, ["actor", "critic"])]
    assert snap.takes["actor"][0] is snap.takes["critic"][0]  # one object per process
    # Ring by node (each process on a node of its own here): the j-th rank of a node is held by the
    # j-th of the next node, so each role's copies stay with the same role on the other process.
    assert snap.holders == {"actor": [("actor", 1), ("actor", 0)], "critic": [("critic", 1), ("critic", 0)]}
    holds = sorted((role, r, a[1]) for role, r, m, a in calls if m == "hold_snapshot")
    # One call per holding process, to the first of its ranks the ring names: actor 1 holds process 0's
    # copies, actor 0 process 1's.
    assert holds == [("actor", 0, [[("actor", 1), ("critic", 1)]]), ("actor", 1, [[("actor", 0), ("critic", 0)]])]
    assert k.is_complete(snap) and snap.bytes == {"actor": [10, 10], "critic": [10, 10]}
    # Process 1 restarts and its object-store copy is lost: its ranks read the copies process 0 holds
    # (held per process: actor 0 keeps both).
    actor.restart(1)
    critic.restart(1)
    actor.store_lost = critic.store_lost = {1}
    assert k.restore(roles, None).step == 4
    assert actor.loaded == {0: ("own", "actor0@4"), 1: ("peer", "actor1@4")}
    assert critic.loaded == {0: ("own", "critic0@4"), 1: ("peer", "critic1@4")}


def test_complete_only_once_every_take_seal_and_publish_answered():
    g = FakeGroup(2)
    k = keeper()
    g.take_pending = g.publish_pending = g.seal_pending = True
    snap = k.take(FakeRoles(g), 3, {"step": 3})
    assert not k.is_complete(snap)
    for r in snap.done["actor"]:
        r.ready = True
    assert not k.is_complete(snap), "the copies are not in the object store yet"
    for r in snap.published:
        r.ready = True
    assert not k.is_complete(snap), "the copies are not checksummed yet"
    for r in snap.sealed:
        r.ready = True
    assert k.is_complete(snap) and snap.bytes == {"actor": [10, 10]}


def test_one_node_asks_no_peer_and_reads_the_object_store():
    """Every stateful rank on one node: a peer there would keep a view of the same object-store
    memory, so no hold is sent; a restarted rank reads the object store's copy."""
    actor, critic = FakeGroup(2, "actor"), FakeGroup(1, "critic")
    one_node = {(role, r): "n0" for role, n in (("actor", 2), ("critic", 1)) for r in range(n)}
    roles = FakeRoles(actor, critic, nodes=one_node)
    events = []
    k = keeper(events=events)
    snap = k.take(roles, 6, {"step": 6})
    assert snap.holds == [] and snap.holders == {"actor": [None, None], "critic": [None]}
    assert not any(m == "hold_snapshot" for g in (actor, critic) for _, m, _ in g.calls)
    assert k.is_complete(snap) and snap.bytes == {"actor": [10, 10], "critic": [10]}
    actor.restart(1)
    assert k.restore(roles, None).step == 6
    assert actor.loaded[1] == ("object_store", "actor1@6")
    # The node's object store is gone too: no copy is left, and no peer is asked for one.
    actor.restart(1)
    actor.store_lost = {1}
    actor.calls.clear()
    assert k.restore(roles, None) is None
    assert events[-1][0] == "snapshot_unusable" and "actor rank(s) [1]" in events[-1][1]["reason"]
    assert not any(m == "held_snapshot" for _, m, _ in actor.calls + critic.calls)


def test_one_node_keeps_a_peer_copy_where_the_object_store_is_not_read():
    g = FakeGroup(2)
    roles = FakeRoles(g, nodes={("actor", 0): "n0", ("actor", 1): "n0"})
    k = keeper(max_task_retries=1)
    snap = k.take(roles, 5, {"step": 5})
    assert snap.holders == {"actor": [("actor", 1), ("actor", 0)]}
    g.restart(1)
    assert k.restore(roles, None).step == 5 and g.loaded[1] == ("peer", "actor1@5")


def test_a_process_is_never_its_own_peer():
    actor, critic = FakeGroup(1, "actor"), FakeGroup(1, "critic")
    k = keeper(max_task_retries=1)
    snap = k.take(FakeRoles(actor, critic, colocated=True), 2, {"step": 2})
    assert snap.holds == [] and snap.holders == {"actor": [None], "critic": [None]}
