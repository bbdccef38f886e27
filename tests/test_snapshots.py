"""Controller-side bookkeeping of in-memory snapshots (trainer/snapshots.py) against fake groups."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from resilient_rl.errors import WorkerDiedError
from resilient_rl.workers.snapshots.ring import ring_holders
from resilient_rl.workers.snapshots.keeper import SnapshotKeeper
from resilient_rl.workers.snapshots.node_memory import NodeCopy
from resilient_rl.workers.snapshots.slots import KEEP


class Ref:
    def __init__(self, value=None, error=None, ready=True):
        self.value, self.error, self.ready = value, error, ready

    def resolve(self):
        if self.error is not None:
            raise self.error
        return self.value


def fake_wait(refs, num_returns, timeout, fetch_local):
    if timeout:  # waited for: the answers in flight arrive
        for r in refs:
            r.ready = True
    ready = [r for r in refs if r.ready]
    return ready, [r for r in refs if not r.ready]


def fake_get(refs, timeout=None):
    return [r.resolve() for r in refs]


class FakeGroup:
    """Ranks that keep snapshots like RankSnapshots, minus the tensors."""

    def __init__(self, n, role="actor"):
        self.world_size, self.role = n, role
        self.own = [dict() for _ in range(n)]  # rank -> step -> state
        self.held = [dict() for _ in range(n)]  # rank -> (owner, step) -> state
        self.store_lost: set[int] = set()
        self.dead_holders: set[int] = set()
        self.dead_loaders: set[int] = set()  # ranks whose process dies when asked to load
        self.loaded: dict[int, tuple] = {}
        self.calls: list[tuple] = []
        self.hold_pending = self.take_pending = self.publish_pending = self.seal_pending = False
        self.take_error: set[int] = set()
        self.died_taking: set[int] = set()  # ranks whose process dies during the take (no copy at all)
        self.died_sealing: set[int] = set()  # ranks whose process dies after its take, before its seal
        self.sealed: set[tuple[int, str]] = set()  # (rank, snapshot id) of the sealed node copies
        self.node: list[dict] = [dict() for _ in range(n)]  # rank -> snapshot id -> state in its node's memory
        self.node_error: set[int] = set()  # ranks whose node memory is unusable
        self.node_lost: set[int] = set()  # ranks now on another node than their node copies
        self.corrupt: set[tuple[int, str]] = set()  # (rank, source) whose copy fails its checksum
        self.siblings: dict[str, "FakeGroup"] = {}  # role -> group sharing this group's processes

    def execute_rank_async(self, rank, method, *args):
        self.calls.append((rank, method, args))
        if method == "take_snapshot":
            step, take_roles, where = args
            if rank in self.take_error:
                return Ref(error=RuntimeError(f"rank {rank} died"))
            if rank in self.died_taking:
                return Ref(error=ActorDiedError())
            failed = {}
            for role in take_roles:  # this process's roles (colocated ones in sibling groups)
                g = self.siblings.get(role, self)
                g.own[rank][step] = f"{role}{rank}@{step}"
                if where is not None and rank in g.node_error:
                    failed[role] = "OSError: [Errno 28] No space left on device"
                elif where is not None:
                    g.node[rank][where["id"]] = (where["dir"], f"{role}{rank}@{step}")
            return Ref({"step": step, "bytes": {role: 10 for role in take_roles}, "node_failed": failed},
                       ready=not self.take_pending)
        if method == "seal_snapshot":
            step, take_roles, _timeout_s = args
            if rank in self.take_error:
                return Ref(error=RuntimeError(f"seal_snapshot: the copy of step {step} is gone"))
            if rank in self.died_taking | self.died_sealing:
                return Ref(error=ActorDiedError())
            for role in take_roles:
                g = self.siblings.get(role, self)
                g.sealed |= {(rank, i) for i, (_, state) in g.node[rank].items() if state.endswith(f"@{step}")}
            return Ref({"step": step, "checksums": {role: "xxh3_64:0" for role in take_roles}},
                       ready=not self.seal_pending)
        if method == "publish_snapshot":
            step, take_roles, _timeout_s = args
            if rank in self.take_error:
                error = RuntimeError(f"publish_snapshot: the copy of step {step} is gone")
                return [Ref(error=error), Ref(error=error)]
            out = {role: {"step": step, "rank": rank, "bytes": 10, "state": f"{role}{rank}@{step}"}
                   for role in take_roles}
            return [Ref({"step": step}, ready=not self.publish_pending), Ref({"step": step, "rank": rank, "roles": out})]
        if method == "hold_snapshot":
            step, owners, takes, _timeout_s = args
            for take in takes:
                if take.error is not None:
                    return Ref(error=take.error)
            for keys, take in zip(owners, takes):
                for owner_role, owner in keys:
                    self.held[rank][(owner_role, owner, step)] = take.value["roles"][owner_role]
            return Ref({"step": step, "kept": sum(map(len, owners))}, ready=not self.hold_pending)
        if method == "held_snapshot":
            step, owner_role, owner = args
            if rank in self.dead_holders:
                return Ref(error=RuntimeError("holder lost"))
            for g in {id(g): g for g in [self, *self.siblings.values()]}.values():  # any role of the process
                if (owner_role, owner, step) in g.held[rank]:
                    return Ref(g.held[rank][(owner_role, owner, step)])
            return Ref(None)
        if method == "node_copy_here":
            step, source = args
            where, state = self.node[rank].get(source.snap_id, (None, None))
            return Ref(rank not in self.node_lost and where == source.run_dir and state is not None)
        if method == "load_snapshot":
            step, source, _timeout = args
            if rank in self.dead_loaders:
                return Ref(error=WorkerDiedError(f"{self.role} rank {rank} died", role=self.role, rank=rank,
                                                 cause="died"))
            if source is None:
                state = self.own[rank].get(step)
                kind = "own"
            elif isinstance(source, NodeCopy):
                where, state = self.node[rank].get(source.snap_id, (None, None))
                if rank in self.node_lost or where != source.run_dir:
                    state = None
                kind = "node"
            elif isinstance(source, list):
                state = None if rank in self.store_lost else source[0].value["roles"][self.role]["state"]
                kind = "object_store"
            else:  # a ref resolved by Ray before the call
                if source.error is not None:
                    return Ref(error=source.error)
                state = source.value["state"] if source.value else None
                kind = "peer"
            if state is None:
                return Ref(False)
            if (rank, kind) in self.corrupt:
                return Ref({"corrupt": f"checksum xxh3_64:1 does not match the recorded xxh3_64:0 ({kind})"})
            self.loaded[rank] = (kind, state)
            return Ref("unsealed" if kind == "node" and (rank, source.snap_id) not in self.sealed else True)
        raise AssertionError(method)

    def get(self, refs, timeout_s=None):
        return fake_get(refs)

    def restart(self, rank):
        self.own[rank], self.held[rank] = {}, {}


class FakeRoles:
    """Each role in its own processes, or (``colocated``) every role's rank r in process r; each
    process on a node of its own unless ``nodes`` ((role, rank) -> node) says otherwise."""

    def __init__(self, *groups, nodes=None, colocated=False):
        self.groups = list(groups)
        self.nodes = nodes or {}
        self.colocated = colocated
        if colocated:
            for g in groups:
                g.siblings = {h.role: h for h in groups}

    def checkpoint_groups(self):
        return [(g.role, g) for g in self.groups]

    def role_processes(self):
        out = {}
        for g in self.groups:
            for r in range(g.world_size):
                pid = f"p{r}" if self.colocated else f"{g.role}{r}"
                out[(g.role, r)] = (pid, self.nodes.get((g.role, r), f"node-of-{pid}"))
        return out


def keeper(every=1, max_task_retries=0, events=None, node_dir="", record_path=None):
    cfg = SimpleNamespace(snapshot_every=every, max_task_retries=max_task_retries, call_timeout_s=10.0,
                          snapshot_node_dir=node_dir, snapshot_hand_over_s=600.0)
    emit = (lambda kind, **f: events.append((kind, f))) if events is not None else (lambda kind, **f: None)
    return SnapshotKeeper(cfg, emit=emit, wait=fake_wait, get=fake_get, run_key="run", record_path=record_path)


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


# ---------------------------------------------------------------------------- node memory


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
