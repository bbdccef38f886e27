"""Faults around checkpoints: a kill mid-write, damaged shards, flaky, slow and full storage."""

from __future__ import annotations

import pytest

from suite import STORAGE_ONLY, held_save, storage_overrides
from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.faults.storage import FaultPlan


def test_kill_during_checkpoint_write_never_becomes_latest(reference, chaos_run, chaos_dir):
    """Step 4's shards are held in flight; actor rank 1 dies while writing them."""
    extra, release = held_save(chaos_dir, "killwrite", 4)
    schedule = FaultSchedule().at_checkpoint(4).kill("actor", 1, delay_s=0.1)
    result = chaos_run(schedule, *extra, *STORAGE_ONLY, hooks=(release,))
    check_invariants(result, reference)
    assert [e["step"] for e in result.events_of("checkpoint_abandoned")] == [4]
    assert result.events_of("recovered")[0]["restored_step"] == 2, "the torn step-4 save was never loaded"


def test_a_save_abandoned_for_a_rank_that_writes_none_is_saved_again(reference, chaos_run, chaos_dir):
    """Step 2's shards are held in flight until a recovery begins (the other saves and loads are not
    held); the rollout (which writes no checkpoint) is killed meanwhile, and the recovery abandons
    the save. Restored from step 2's snapshot, the run saves step 2 again: it keeps the checkpoints
    the fault-free run keeps (before, step 2 was lost for good, the durable interval silently
    doubled). A slow save instead of a held one raced the failure's detection and sometimes won."""
    extra, release = held_save(chaos_dir, "resave", 2)
    schedule = FaultSchedule().at_checkpoint(2).kill("rollout", 0, delay_s=0.05)
    result = chaos_run(schedule, *extra, "recovery.snapshot_every=1", hooks=(release,))
    check_invariants(result, reference)
    kinds = [(e["event"], e.get("step", e.get("failed_step"))) for e in result.events]
    assert 2 in [e["step"] for e in result.events_of("checkpoint_abandoned")], kinds
    assert result.events_of("recovered")[0]["restored_step"] == 2


def test_a_save_abandoned_and_restored_past_is_replaced_by_a_save_of_the_restored_step(reference, chaos_run, chaos_dir):
    """Step 2's save is still in flight when actor rank 1 dies at step 4; the recovery abandons it
    and restores step 3's snapshot, past step 2, which is never trained again. The run saves step 3
    at once: before, no checkpoint existed until step 4 (the newest durable state stayed a whole
    interval older than the schedule promises, and here there was none)."""
    extra, release = held_save(chaos_dir, "pastsave", 2)
    schedule = FaultSchedule().after_snapshot(4).kill("actor", 1)
    result = chaos_run(schedule, *extra, "recovery.snapshot_every=1", hooks=(release,))
    check_invariants(result, reference)
    assert [e["step"] for e in result.events_of("checkpoint_abandoned")] == [2]
    assert [(e["restored_step"], e["source"]) for e in result.events_of("recovered")] == [(3, "snapshot")]
    assert result.committed == [3, 4, 6] and reference.committed == [2, 4, 6]


@pytest.mark.parametrize("damage", ["corrupt", pytest.param("truncate", marks=pytest.mark.slow)])
def test_damaged_checkpoint_is_detected_and_the_previous_one_used(reference, chaos_run, damage):
    schedule = FaultSchedule().at_step(6)
    schedule.corrupt_latest_checkpoint(truncate=damage == "truncate").kill("critic", 0, delay_s=0.05)
    result = chaos_run(schedule, *STORAGE_ONLY)
    check_invariants(result, reference)
    assert schedule.faults[0].path.endswith("step_00000004/actor/shard_00000.safetensors")
    assert [e["step"] for e in result.events_of("checkpoint_corrupt")] == [4]
    assert result.events_of("recovered")[0]["restored_step"] == 2


def test_transient_storage_errors_are_retried(reference, chaos_run, chaos_dir, caplog):
    extra = storage_overrides(chaos_dir, "flaky", FaultPlan(transient_writes=3, transient_reads=2))
    with caplog.at_level("WARNING", logger="resilient_rl.checkpoint.retry"):
        result = chaos_run(None, *extra)
    check_invariants(result, reference, expect_recoveries=0)
    retried = [r for r in caplog.records if "injected" in r.getMessage() and "retrying" in r.getMessage()]
    assert len(retried) >= 5, "the controller's 3 write and 2 read faults were injected and retried"


@pytest.mark.slow  # a failing write is stopped on in tests/test_checkpoint_io_faults.py
def test_full_disk_stops_cleanly_and_resume_finishes(reference, chaos_run, chaos_dir):
    """ENOSPC on the second save: the run stops naming the problem; the first checkpoint stays latest."""
    shard = max(reference.extra.get("shard_sizes", {"x": 0}).values(), default=0) or 400_000
    extra = storage_overrides(chaos_dir, "full", FaultPlan(enospc_after_bytes=int(shard * 1.5)))
    result = chaos_run(None, *extra, name="full-disk")
    assert result.error is not None and "No space left" in str(result.error), result.error
    assert result.committed and result.latest == result.committed[-1] == 2
    assert all(v == "ok" for v in result.verify.values())
    # The same run resumed on healthy storage (same folder) ends where the reference ends.
    resumed = chaos_run(None, f"checkpoint.root={chaos_dir}/ckpt-full", name="full-disk")
    assert resumed.events_of("checkpoint_restored")[0]["step"] == 2
    check_invariants(resumed, reference, expect_recoveries=0)
