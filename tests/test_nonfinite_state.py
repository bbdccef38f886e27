"""The NaN guard's counters roll back with the run: a step replayed after a recovery or a resume
counts its NaN once and spends the budget once, as the run without the failure did; a rollback
past a NaN keeps them, so its budget is never refilled."""

from __future__ import annotations

import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.errors import NonFiniteError
from resilient_rl.recovery.rollback import AFTER_FAILURE
from resilient_rl.testing.checkpoint_roles import LocalCheckpointRoles
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.trainer.ppo import PPOTrainer

NAN_REWARD = {"reward/nonfinite": 1.0}
NAN_LOSS = {"actor/nonfinite_skipped": 1.0}


def _trainer(tmp_path, *extra, roles_factory=LocalRoles) -> PPOTrainer:
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                             "trainer.run_name=guard", "telemetry.enabled=false", "trainer.total_steps=10",
                             *extra])
    return PPOTrainer(cfg, roles_factory=roles_factory)


def test_a_step_replayed_from_a_snapshot_counts_its_nan_once(tmp_path):
    trainer = _trainer(tmp_path, "trainer.max_nonfinite=2")
    guard = trainer.nonfinite
    assert guard.after_step({"step": 1, **NAN_REWARD})
    snapshot = trainer.state_dict()  # what the snapshot of step 1 holds
    assert guard.after_step({"step": 2, **NAN_REWARD})  # two in a row: within the budget
    # A worker dies in step 3; the recovery restores the snapshot of step 1 and replays step 2.
    trainer.load_state_dict(snapshot)
    assert (guard.in_a_row, guard.total) == (1, 1)
    assert guard.after_step({"step": 2, **NAN_REWARD})  # before: counted a third time, and raised
    assert (guard.in_a_row, guard.total) == (2, 2)
    with pytest.raises(NonFiniteError, match="3 step"):  # the budget itself is unchanged
        guard.after_step({"step": 3, **NAN_REWARD})


class _CheckpointingRoles:
    """A roles factory whose pool saves checkpoints: the trainer's rollbacks restore them."""

    writes_checkpoints = True

    def __call__(self, cfg, tokenizer):
        raise AssertionError("the test hands the trainer its roles")


def _save(trainer: PPOTrainer, roles, step: int) -> None:
    roles.train_step(step)
    trainer.step = step
    trainer.save_checkpoint()  # checkpoint.async_save=false: committed before it returns


def test_a_recovery_and_a_resume_from_a_checkpoint_count_as_the_run_without_the_failure(tmp_path):
    """trainer.nonfinite=rollback, one NaN step tolerated: step 3 meets a NaN and the run rolls back
    to step 2; the known-good checkpoint of step 4 ends that row. A failure in step 5 restores step 4,
    whose state was taken before its commit ended the row: restored, the commit still counts, so
    step 5's NaN is the first of a row, as without the failure (not the second, stopping the run).
    A new controller resuming the run counts it the same way (before: a fresh guard, its NaN
    count lost)."""
    args = ("trainer.nonfinite=rollback", "trainer.max_nonfinite=1", "checkpoint.save_every=2",
            "checkpoint.async_save=false")
    trainer = _trainer(tmp_path, *args, roles_factory=_CheckpointingRoles())
    guard = trainer.nonfinite
    with LocalCheckpointRoles() as roles:
        roles.sync_weights = lambda version: {}  # no rollout among these roles
        trainer.roles = roles
        _save(trainer, roles, 2)
        verdict = guard.after_step({"step": 3, **NAN_LOSS})
        assert not verdict
        trainer.roll_back_nonfinite(3, verdict.roll_back)
        assert trainer.step == 2 and (guard.in_a_row, guard.total, guard.awaiting_good) == (1, 1, True)
        assert guard.after_step({"step": 3}) and guard.in_a_row == 1  # a clean step proves nothing yet
        _save(trainer, roles, 4)  # known good: ends the row
        assert (guard.in_a_row, guard.awaiting_good) == (0, False)
        assert trainer.rollback.roll_back_to(roles, *AFTER_FAILURE) == 4  # a worker died in step 5
        assert (guard.in_a_row, guard.total, guard.awaiting_good, guard.dirty) == (0, 1, False, False)
        assert not guard.after_step({"step": 5, **NAN_LOSS})  # rolled back, not raised
        resumed = _trainer(tmp_path, *args, roles_factory=_CheckpointingRoles())
        assert resumed.rollback.roll_back_to(roles, *AFTER_FAILURE) == 4
        assert (resumed.nonfinite.in_a_row, resumed.nonfinite.total) == (0, 1)
        assert not resumed.nonfinite.after_step({"step": 5, **NAN_LOSS})


def test_a_rollback_past_a_nan_keeps_the_budget_spent(tmp_path):
    args = ("trainer.nonfinite=rollback", "trainer.max_nonfinite=1", "checkpoint.save_every=2",
            "checkpoint.async_save=false")
    trainer = _trainer(tmp_path, *args, roles_factory=_CheckpointingRoles())
    guard = trainer.nonfinite
    with LocalCheckpointRoles() as roles:
        roles.sync_weights = lambda version: {}
        trainer.roles = roles
        _save(trainer, roles, 2)
        verdict = guard.after_step({"step": 3, **NAN_LOSS}, trainer.ckpt.last_committed)
        trainer.roll_back_nonfinite(3, verdict.roll_back)
        assert trainer.step == 2 and guard.in_a_row == 1  # not the checkpoint's 0
        with pytest.raises(NonFiniteError, match=r"step 3: .*2 step\(s\) in a row"):  # the next data: NaN again
            guard.after_step({"step": 3, **NAN_LOSS}, trainer.ckpt.last_committed)
