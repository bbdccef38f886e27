"""In-memory snapshots (recovery.snapshot_every): a failure loses at most the failed step.

Storage checkpoints are rare here (``checkpoint.save_every=20``: only the run's last step is
saved), so every recovery below must come from a snapshot held in memory, and the run must still
end bit-identical to the fault-free reference.
"""

from __future__ import annotations

from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule

SNAPSHOTS = ("checkpoint.save_every=20", "recovery.snapshot_every=1")


def _recovered(result) -> dict:
    recovered = result.events_of("recovered")
    assert len(recovered) == 1, recovered
    return recovered[0]


def test_sigkill_actor_rank_replays_only_the_failed_step(reference, chaos_run):
    # Inside step 4 (not at its very start, where the kill would race step 3's snapshot: that
    # case is test_failure_during_a_snapshot).
    result = chaos_run(FaultSchedule().at_step(4).kill("actor", 1, delay_s=0.5), *SNAPSHOTS)
    check_invariants(result, reference)
    rec = _recovered(result)
    assert rec["steps_replayed"] == 0 and rec["source"] == "snapshot", rec
    assert rec["restored_step"] == rec["failed_step"] - 1
    restored = result.events_of("snapshot_restored")
    assert restored[0]["step"] == rec["restored_step"] and restored[0]["sources"].get("own") >= 1
    assert not result.events_of("checkpoint_restored"), "storage was read"


def test_failure_during_a_snapshot(reference, chaos_run):
    """Killed while the snapshot of step 3 is being copied and handed to its peer: that snapshot
    is used only if every rank finished it, else the one of step 2."""
    result = chaos_run(FaultSchedule().at_snapshot(3).kill("actor", 0), *SNAPSHOTS)
    check_invariants(result, reference)
    rec = _recovered(result)
    assert rec["source"] == "snapshot" and rec["restored_step"] in (2, 3)


def test_owner_and_holder_killed_together(reference, chaos_run):
    """Both actor ranks (each the other's ring peer) die: their own and held copies are gone;
    the object store's copies remain."""
    result = chaos_run(FaultSchedule().at_step(4).kill("actor", 0, delay_s=0.5).kill("actor", 1, delay_s=0.5),
                       *SNAPSHOTS)
    check_invariants(result, reference)
    rec = _recovered(result)
    assert rec["steps_replayed"] == 0 and rec["source"] == "snapshot", rec
    sources = result.events_of("snapshot_restored")[0]["sources"]
    assert sources.get("object_store", 0) >= 2 and "own" in sources  # the critic survived with its own
