"""Checkpoint I/O failures are recovered or skipped: a writer killed with the last save pending,
a storage outage over a few saves, an outage longer than ``checkpoint.max_skipped``."""

from __future__ import annotations

import pytest

from suite import STORAGE_ONLY, held_save, storage_overrides
from resilient_rl.cli import EXIT_RUNTIME, exit_code
from resilient_rl.errors import CheckpointsSkippedError
from resilient_rl.faults.harness import check_invariants, metric_totals
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.faults.storage import FaultPlan


@pytest.mark.slow  # a kill during a write: chaos/test_checkpoint_faults.py
def test_worker_killed_with_the_last_save_pending_recovers(reference, chaos_run, chaos_dir):
    """The final step's shards are held in flight while actor rank 1 dies: the wait for the last
    save is inside the recovery, so the run rolls back to step 4 and replays to the end."""
    extra, release = held_save(chaos_dir, "lastsave", 6)
    schedule = FaultSchedule().at_checkpoint(6).kill("actor", 1, delay_s=0.1)
    result = chaos_run(schedule, *extra, *STORAGE_ONLY, hooks=(release,))
    check_invariants(result, reference)
    assert [e["step"] for e in result.events_of("checkpoint_abandoned")] == [6]
    assert result.events_of("recovered")[0]["restored_step"] == 4
    assert result.committed[-1] == result.latest == 6


def test_worker_killed_with_the_last_save_pending_and_the_last_snapshot_complete_commits_the_last_step(
        reference, chaos_run, chaos_dir):
    """The last step's snapshot is complete and its save still in flight when actor rank 1 dies:
    the recovery abandons the save and restores the snapshot, which is the last step. The run then
    saves that step again: before, it ended as complete with the last step never committed."""
    extra, release = held_save(chaos_dir, "lastsnap", 6)
    schedule = FaultSchedule().at_final_save(6).kill("actor", 1)
    result = chaos_run(schedule, *extra, "recovery.snapshot_every=1", hooks=(release,))
    check_invariants(result, reference)
    assert [e["step"] for e in result.events_of("checkpoint_abandoned")] == [6]
    assert [(e["restored_step"], e["source"]) for e in result.events_of("recovered")] == [(6, "snapshot")]
    assert result.committed[-1] == result.latest == 6 and result.verify[6] == "ok"


def test_storage_outage_skips_checkpoints_while_training_goes_on(reference, chaos_run, chaos_dir):
    """Step 2's actor shards (written by the workers) and all of step 4 (the controller's trainer
    state first) meet an outage longer than the retries; step 6 is saved."""
    plan = FaultPlan(outage_paths="step_00000002/actor,step_00000004/")
    result = chaos_run(None, *storage_overrides(chaos_dir, "outage", plan))
    check_invariants(result, reference, expect_recoveries=0, same_checkpoints=False)  # skipped on purpose
    assert [(e["step"], e["reason"]) for e in result.events_of("checkpoint_skipped")] == [(2, "storage"),
                                                                                          (4, "storage")]
    assert result.committed == [6]
    assert not result.events_of("failure"), "a storage outage during a save is not a worker failure"
    if result.metrics_text:
        assert metric_totals(result.metrics_text).get("rrl_checkpoint_skipped_total") == 2


@pytest.mark.slow
def test_outage_longer_than_max_skipped_stops_with_the_last_commit_intact(chaos_run, chaos_dir):
    plan = FaultPlan(outage_paths="step_00000004/,step_00000006/actor")
    result = chaos_run(None, *storage_overrides(chaos_dir, "long-outage", plan), "checkpoint.max_skipped=1")
    assert isinstance(result.error, CheckpointsSkippedError), repr(result.error)
    assert "checkpoint.max_skipped=1" in str(result.error) and "last committed checkpoint is step 2" in str(result.error)
    assert exit_code(result.error) == EXIT_RUNTIME
    assert [e["step"] for e in result.events_of("checkpoint_skipped")] == [4, 6]
    assert result.committed == [2] and result.latest == 2 and result.verify == {2: "ok"}
