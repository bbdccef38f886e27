"""Failures around checkpoint I/O are recovered or skipped, never the end of a run by themselves.

The coordinator drives in-process ranks (the workers' own checkpoint code and background writer,
``resilient_rl/testing/checkpoint_roles.py``) over ``faulty://`` storage: a rank whose process
restarted mid-save, a save slower than ``checkpoint.save_timeout_s``, a storage outage longer
than the retries.
"""

from __future__ import annotations

import pytest

from resilient_rl.cli import EXIT_ERROR, EXIT_RUNTIME, exit_code
from resilient_rl.recovery.causes import classify
from resilient_rl.recovery.policy import Decision, FailurePolicy
from resilient_rl.checkpoint import Storage
from resilient_rl.checkpoint.leases.run_lease import RunLease
from resilient_rl.errors import CheckpointsSkippedError, LeaseLostError, StorageError, WorkerDiedError
from resilient_rl.faults.storage import FaultPlan, faulty_url
from resilient_rl.telemetry.metrics import TrainerMetrics
from resilient_rl.testing.checkpoint_roles import LocalCheckpointRoles
from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
from resilient_rl.config.schema import load_config

RUN = "io"


def _coordinator(tmp_path, plan: FaultPlan, *extra: str, name: str):
    url, options = faulty_url(str(tmp_path / "ckpt"), plan, name=f"{name}-{tmp_path.name}")
    flat = [f"checkpoint.root={url}", f"checkpoint.storage_options.target_protocol={options['target_protocol']}",
            f"checkpoint.storage_options.name={options['name']}"]
    flat += [f"checkpoint.storage_options.plan.{k}={'null' if v is None else v}" for k, v in options["plan"].items()]
    cfg = load_config(None, [f"trainer.run_name={RUN}", f"trainer.output_dir={tmp_path}/runs",
                             "trainer.total_steps=100", "checkpoint.save_every=2", *flat, *extra])
    events: list[tuple[str, dict]] = []
    coord = CheckpointCoordinator(cfg, on_event=lambda kind, **f: events.append((kind, f)))
    return coord, events


def _kinds(events, kind):
    return [f for k, f in events if k == kind]


def _save(coord, roles, step):
    roles.train_step(step)
    return coord.save(roles, step, {"step": step}, "digest")


def test_a_rank_restarted_during_an_async_save_abandons_it_for_recovery(tmp_path):
    """Before: the restarted rank reported no shard and commit raised CheckpointError (fatal)."""
    coord, events = _coordinator(tmp_path, FaultPlan(slow_s=0.05), name="lost")
    with LocalCheckpointRoles() as roles:
        _save(coord, roles, 2)
        coord.wait(roles)
        assert coord.manager.latest_step() == 2
        _save(coord, roles, 4)
        roles.groups["critic"].restart(0)  # the process died while writing step 4 and came back
        with pytest.raises(WorkerDiedError, match="critic rank 0 holds no shard of the checkpoint of step 4") as info:
            coord.wait(roles)
        assert (info.value.role, info.value.rank, classify(info.value).cause) == ("critic", 0, "died")
        assert coord.pending is None and coord.abandoned == 4
        assert _kinds(events, "checkpoint_abandoned") == [{"step": 4, "reason": "writer_lost"}]
        assert coord.manager.latest_step() == 2 and coord.manager.verify(2) == "ok"
        # The run recovers (step 2 restored into every rank) and saves again.
        assert coord.restore(roles)["step"] == 2
        _save(coord, roles, 4)
        assert coord.wait(roles) and coord.manager.latest_step() == 4 and coord.manager.verify(4) == "ok"


def test_a_slow_save_skips_the_next_one_instead_of_failing(tmp_path):
    coord, events = _coordinator(tmp_path, FaultPlan(slow_s=0.2), "checkpoint.save_timeout_s=0.01",
                                 "recovery.call_timeout_s=1", name="slow")
    coord.metrics = TrainerMetrics(run=RUN)
    with LocalCheckpointRoles() as roles:
        _save(coord, roles, 2)
        assert _save(coord, roles, 4) == 0.0  # step 2 is still being written: step 4 is skipped
        assert coord.pending["step"] == 2
        assert [(f["step"], f["reason"]) for f in _kinds(events, "checkpoint_skipped")] == [(4, "slow")]
        assert coord.metrics.checkpoint_skipped.labels(reason="slow")._value.get() == 1
        assert coord.wait(roles, timeout_s=120)  # the slow save still commits
        assert coord.manager.latest_step() == 2 and coord.skipped_in_row == 0
        # The end of a run waits for its last save, bounded, and reports one still being written.
        _save(coord, roles, 6)
        assert coord.finish(roles) is False
        assert _kinds(events, "checkpoint_abandoned") == [{"step": 6, "reason": "slow"}]
        assert coord.manager.latest_step() == 2


def test_a_storage_outage_skips_checkpoints_and_training_goes_on(tmp_path):
    """Step 2's shards (worker side) and step 4's trainer state (controller side) hit an outage."""
    plan = FaultPlan(outage_paths="step_00000002/actor,step_00000004/")
    coord, events = _coordinator(tmp_path, plan, "checkpoint.max_skipped=2", name="outage")
    coord.metrics = TrainerMetrics(run=RUN)
    with LocalCheckpointRoles({"actor": 2, "critic": 1}) as roles:
        _save(coord, roles, 2)
        assert coord.wait(roles) and coord.pending is None
        _save(coord, roles, 4)
        assert coord.pending is None
        skipped = _kinds(events, "checkpoint_skipped")
        assert [(f["step"], f["reason"], f["in_row"]) for f in skipped] == [(2, "storage", 1), (4, "storage", 2)]
        assert "actor rank 0 could not write its shards" in skipped[0]["detail"]
        assert "still failing after" in skipped[1]["detail"]
        assert coord.metrics.checkpoint_skipped.labels(reason="storage")._value.get() == 2
        _save(coord, roles, 6)  # storage is back
        assert coord.wait(roles) and coord.manager.committed_steps() == [6] and coord.skipped_in_row == 0
        assert not coord.manager.storage.exists(f"{RUN}/step_00000002"), "the skipped save's files are cleaned up"


def test_an_outage_longer_than_max_skipped_stops_the_run_with_the_last_commit_intact(tmp_path):
    plan = FaultPlan(outage_paths="step_00000004/,step_00000006/actor")
    coord, events = _coordinator(tmp_path, plan, "checkpoint.max_skipped=1", name="long")
    with LocalCheckpointRoles() as roles:
        _save(coord, roles, 2)
        assert coord.wait(roles)
        _save(coord, roles, 4)
        _save(coord, roles, 6)
        with pytest.raises(CheckpointsSkippedError, match=r"2 checkpoints in a row could not be saved "
                                                          r"\(checkpoint.max_skipped=1\).*last committed checkpoint "
                                                          r"is step 2") as info:
            coord.wait(roles)
        assert exit_code(info.value) == EXIT_RUNTIME
        assert [f["step"] for f in _kinds(events, "checkpoint_skipped")] == [4, 6]
        assert coord.manager.latest_step() == 2 and coord.manager.verify(2) == "ok"


def test_a_permanent_storage_error_still_stops_the_run(tmp_path):
    coord, events = _coordinator(tmp_path, FaultPlan(enospc_after_bytes=2000), name="full")
    with LocalCheckpointRoles() as roles:
        _save(coord, roles, 2)
        with pytest.raises(StorageError, match="No space left") as info:
            coord.wait(roles)
        assert not isinstance(info.value, CheckpointsSkippedError)
        assert _kinds(events, "checkpoint_skipped") == []


def test_a_write_that_fails_after_a_takeover_stops_on_the_lost_lease(tmp_path):
    """A hung controller wakes mid-save after another took the run over and cleaned up the step
    it was writing: its failed write is reported as the takeover (exit 2), not a storage error."""
    coord, events = _coordinator(tmp_path, FaultPlan(enospc_after_bytes=4000), name="taken")
    coord.acquire_lease()
    try:
        with LocalCheckpointRoles() as roles:
            _save(coord, roles, 2)  # fenced: the lease is still ours
            other = RunLease(Storage(str(tmp_path / "ckpt")), RUN, ttl_s=60, renew_s=20, takeover=True)
            other.acquire()
            with pytest.raises(LeaseLostError, match=other.holder) as info:
                coord.wait(roles)
            assert isinstance(info.value.__cause__, StorageError) and "No space left" in str(info.value.__cause__)
            assert exit_code(info.value) == EXIT_ERROR
            other.close()
    finally:
        coord.release_lease()


def test_a_storage_outage_is_recoverable_for_the_failure_policy():
    policy = FailurePolicy(max_restarts=3, max_failures=5, failure_window_s=60)
    outage = classify(StorageError("storage read failed: still failing after 5 attempts", outage=True))
    assert outage.cause == "storage" and policy.decide(outage).decision is Decision.RETRY
    permanent = classify(StorageError("storage write failed: permanent error: No space left"))
    assert permanent.cause == "error" and policy.decide(permanent).decision is Decision.RAISE


@pytest.mark.parametrize("override, key", [("checkpoint.max_skipped=-1", "checkpoint.max_skipped"),
                                           ("checkpoint.save_timeout_s=0", "checkpoint.save_timeout_s")])
def test_checkpoint_io_knobs_are_validated(override, key):
    from resilient_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])
