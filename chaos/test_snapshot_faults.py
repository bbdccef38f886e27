"""In-memory snapshots (recovery.snapshot_every): a failure loses at most the failed step.

Storage checkpoints are rare here (``checkpoint.save_every=20``: only the run's last step is
saved), so every recovery below must come from a snapshot held in memory, and the run must still
end bit-identical to the fault-free reference.
"""

from __future__ import annotations

import os

import pytest

from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule, wait_snapshot
from resilient_rl.faults.nodes import lose_node, node_pids
from resilient_rl.trainer.hooks import TrainerHook

SNAPSHOTS = ("checkpoint.save_every=20", "recovery.snapshot_every=1")


def _recovered(result) -> dict:
    recovered = result.events_of("recovered")
    assert len(recovered) == 1, recovered
    return recovered[0]


@pytest.mark.slow  # with the default config: chaos/test_snapshot_defaults.py
def test_sigkill_actor_rank_replays_only_the_failed_step(reference, chaos_run, node_memory):
    """The killed rank's new process (or spare) reads the copy it left in node memory; the run's
    node memory is gone once it ends."""
    # Once step 3's snapshot is complete (a kill racing it is test_failure_during_a_snapshot).
    result = chaos_run(FaultSchedule().after_snapshot(4).kill("actor", 1), *SNAPSHOTS,
                       f"recovery.snapshot_node_dir={node_memory}")
    assert os.listdir(node_memory) == [], "the run's node memory was left behind"
    check_invariants(result, reference)
    rec = _recovered(result)
    assert (rec["failed_step"], rec["restored_step"], rec["steps_replayed"], rec["source"]) == (4, 3, 0, "snapshot")
    restored = result.events_of("snapshot_restored")
    assert restored[0]["step"] == rec["restored_step"]
    assert restored[0]["sources"].get("own") >= 1 and restored[0]["sources"].get("node") == 1, restored
    assert not result.events_of("checkpoint_restored"), "storage was read"


@pytest.mark.slow  # a tmpfs too small for the rings: chaos/test_snapshot_defaults.py
def test_node_memory_unusable_falls_back_to_the_object_store(reference, chaos_run):
    """A node-memory directory that cannot be created: the first snapshot does not count (the
    event names the directory), later ones keep their copies in the object store, and a killed
    rank reads its copy there."""
    result = chaos_run(FaultSchedule().after_snapshot(4).kill("actor", 1), *SNAPSHOTS,
                       "recovery.snapshot_node_dir=/proc/rrl-no-such-dir")
    check_invariants(result, reference)
    unusable = result.events_of("snapshot_unusable")
    assert unusable and unusable[0]["step"] == 1 and "/proc/rrl-no-such-dir" in unusable[0]["reason"], unusable
    rec = _recovered(result)
    assert (rec["restored_step"], rec["steps_replayed"], rec["source"]) == (3, 0, "snapshot"), rec
    assert result.events_of("snapshot_restored")[0]["sources"].get("object_store") == 1


@pytest.mark.slow  # the fallbacks are unit-tested in tests/test_snapshots.py and test_snapshot_node_memory.py
def test_failure_during_a_snapshot(reference, chaos_run):
    """Killed while the snapshot of step 3 is being copied and handed to its peer: that snapshot
    is used where the killed rank's copy was complete (its take finished: the copy it left in node
    memory, sealed or not, or its peer's), else the one of step 2."""
    result = chaos_run(FaultSchedule().at_snapshot(3).kill("actor", 0), *SNAPSHOTS)
    check_invariants(result, reference)
    rec = _recovered(result)
    assert rec["source"] == "snapshot" and rec["restored_step"] in (2, 3)


@pytest.mark.slow  # the fallbacks are unit-tested in tests/test_snapshots.py and test_snapshot_node_memory.py
def test_owner_and_holder_killed_together(reference, chaos_run):
    """Both actor ranks die with their own processes (on one node no peer keeps another copy:
    the copies they left in node memory outlive them). Their new processes load those (the
    object store's, where node memory is unusable), the critic, which survived, its own."""
    result = chaos_run(FaultSchedule().after_snapshot(4).kill("actor", 0).kill("actor", 1), *SNAPSHOTS)
    check_invariants(result, reference)
    rec = _recovered(result)
    assert (rec["restored_step"], rec["steps_replayed"], rec["source"]) == (3, 0, "snapshot"), rec
    sources = result.events_of("snapshot_restored")[0]["sources"]
    where = "node" if os.access("/dev/shm", os.W_OK) else "object_store"  # recovery.snapshot_node_dir's default
    assert sources.get(where, 0) >= 2, sources
    assert "own" in sources  # the critic survived with its own


class _RemoveActorNode(TrainerHook):
    """Hook: remove the node hosting actor rank 1, with its processes, when step ``step`` starts
    (once step ``step - 1``'s snapshot is complete); remembers which stateful ranks lived elsewhere."""

    def __init__(self, cluster, step: int, replacement_cpus: int):
        self.cluster, self.step, self.removed, self.survivors = cluster, step, None, []
        self.replacement_cpus = replacement_cpus

    def on_step_start(self, trainer, step):
        if step != self.step or self.removed:
            return
        wait_snapshot(trainer, step - 1)
        places = trainer.roles.role_processes()
        node_id = places[("actor", 1)][1]
        self.survivors = [key for key in (("actor", 0), ("actor", 1), ("critic", 0)) if places[key][1] != node_id]
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.removed = node_id
        lose_node(self.cluster, node, node_pids(trainer.roles.known_workers, node_id))
        # A replacement node (as an autoscaler would add): the lost ranks need its CPUs to restart.
        self.cluster.add_node(num_cpus=self.replacement_cpus)


@pytest.mark.slow
def test_node_loss_recovers_from_a_peer_on_another_node(reference, chaos_dir):
    """Two worker nodes (2 and 3 CPUs, one CPU per process: the actor's two ranks fill one node
    or share the other with one more role). The node of actor rank 1 is removed (and a
    replacement added, where the lost ranks restart): its own and object-store copies go with
    it. When a stateful rank (the critic) lives on the other node, it holds the actor's peer
    copies and the run recovers from them without reading storage; when none does, every copy
    is lost and the run falls back to storage. Either way: bit-identical.
    With warm spares (``RRL_CHAOS_RECOVERY=fast``) each node has room for two more processes, as
    a cluster provisioned for its spares would: the four groups' spares fit beside the ranks."""
    import ray
    from ray.cluster_utils import Cluster

    from suite import chaos_overrides, recovery_mode
    from resilient_rl.faults.harness import run_training

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        room = 2 if "recovery.spares=1" in recovery_mode() else 0
        cluster.add_node(num_cpus=2 + room)
        cluster.add_node(num_cpus=3 + room)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rrl-chaos-snap-nodes", log_to_driver=False,
                 configure_logging=False)
        hook = _RemoveActorNode(cluster, step=4, replacement_cpus=3 + room)
        result = run_training(chaos_overrides(chaos_dir) + list(SNAPSHOTS) + [
            "ray.cpus_per_worker=1", "recovery.restart_timeout_s=120",
            "checkpoint.shared_filesystem=true",  # the simulated nodes share this machine's disk
        ], "snap-node-loss", hooks=(hook,))
        assert hook.removed is not None
        check_invariants(result, reference)  # while the cluster is up: it looks for leftover actors
    finally:
        ray.shutdown()
        cluster.shutdown()
    rec = result.events_of("recovered")[-1]
    if ("critic", 0) in hook.survivors:
        assert rec["source"] == "snapshot" and rec["steps_replayed"] == 0, rec
        # The lost actor ranks read copies that lived off their node: the peer's, or the object
        # store's, which Ray still serves from the copy the peer's node fetched for its hold.
        sources = result.events_of("snapshot_restored")[-1]["sources"]
        assert sources.get("peer", 0) + sources.get("object_store", 0) >= 2, sources
        assert not result.events_of("checkpoint_restored"), "storage was read"
    else:
        assert rec["source"] in ("checkpoint", "start"), rec


class _FlipNodeMemory(TrainerHook):
    """Hook: when step ``step`` starts (after the schedule's fault, once the snapshot of step
    ``step - 1`` is complete), flip bytes of ``role`` rank ``rank``'s copy of that snapshot in
    node memory, as a torn write or a bad page would."""

    def __init__(self, step: int, role: str, rank: int):
        self.step, self.role, self.rank, self.flipped = step, role, rank, None

    def on_step_start(self, trainer, step):
        if step != self.step or self.flipped:
            return
        from resilient_rl.workers.snapshots.node_memory import NodeFiles, node_path

        snap = next(s for s in trainer.snapshots.snapshots if s.step == step - 1)
        copy = snap.node[self.role][self.rank]
        files = NodeFiles(node_path(copy.run_dir), self.role, self.rank)
        slot, meta, _ = files.find(2, snap.step, copy.snap_id)
        path = files._path(slot, "data")
        with open(path, "r+b") as f:
            f.seek(int(meta["bytes"]) // 2)
            byte = f.read(1)
            f.seek(int(meta["bytes"]) // 2)
            f.write(bytes([byte[0] ^ 0x5A]))
        self.flipped = path


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_bytes_flipped_in_node_memory_are_detected_and_never_restored(reference, chaos_dir):
    """Actor rank 1's copy of step 3 in node memory is damaged, then the rank is killed: its new
    process finds the checksum wrong, reports it and does not load it; with no other copy of
    that rank (one node, node memory keeps it) the snapshot is unusable and the run restores the
    next source: the older snapshot (step 2) or the checkpoint of step 2. Bit-identical all the same."""
    from suite import RESULTS, chaos_overrides, ensure_ray
    from resilient_rl.faults.harness import run_training

    ensure_ray()
    hook = _FlipNodeMemory(step=4, role="actor", rank=1)
    schedule = FaultSchedule().after_snapshot(4).kill("actor", 1)
    result = run_training(chaos_overrides(chaos_dir) + ["recovery.snapshot_every=1", "recovery.spares=0"],
                          "snap-flipped-node-memory", schedule, hooks=(hook,))
    RESULTS.append(result)
    assert hook.flipped is not None
    check_invariants(result, reference)
    corrupt = result.events_of("snapshot_corrupt")
    assert [(e["step"], e["role"], e["rank"], e["source"]) for e in corrupt] == [(3, "actor", 1, "node")], corrupt
    rec = _recovered(result)
    # The next source: the older snapshot of step 2 where it is still kept (the newer one was not
    # yet known complete when step 3's was started), else the checkpoint of step 2.
    assert rec["restored_step"] == 2 and rec["source"] in ("snapshot", "checkpoint"), rec
    assert [e["step"] for e in result.events_of("snapshot_restored")] == ([2] if rec["source"] == "snapshot" else [])
    assert "rrl_snapshot_corrupt_total{" in result.metrics_text and 'source="node"' in result.metrics_text
