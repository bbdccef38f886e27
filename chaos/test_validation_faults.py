"""A worker killed during a validation pass: the pass is done again and the run ends as if nothing
had happened (metric history with its val/ metrics, final weights and controller state)."""

from __future__ import annotations

import pytest

from suite import STEPS, chaos_overrides, ensure_ray
from resilient_rl.faults.harness import check_invariants, run_training
from resilient_rl.faults.injectors import FaultSchedule

#: Held-out prompts of the built-in task, validated before training and after steps 3 and 6, two
#: generation calls per pass.
VALIDATION = ("data.val_num_prompts=8", "data.val_batch_size=4", "trainer.test_freq=3",
              "trainer.val_before_train=true")


@pytest.fixture(scope="module")
def val_reference(chaos_dir):
    """The fault-free run with validation."""
    ensure_ray()
    result = run_training(chaos_overrides(chaos_dir) + list(VALIDATION), "reference-val")
    assert result.error is None, result.error
    assert [r["step"] for r in result.history] == list(range(0, STEPS + 1))
    assert [r["step"] for r in result.history if "val/reward_mean" in r] == [0, 3, 6]
    return result


def test_rollout_killed_during_validation(val_reference, chaos_run):
    # The pass before training (back to the start) and the pass after step 3 (back to a
    # snapshot or the checkpoint of step 2, then step 3 and its pass again).
    schedule = FaultSchedule().at_validation(0).kill("rollout", 0).at_validation(3).kill("rollout", 0)
    result = chaos_run(schedule, *VALIDATION)
    check_invariants(result, val_reference, expect_recoveries=2)
    assert [f["step"] for f in result.events_of("failure")] == [1, 3]
    assert [r["step"] for r in result.history if "val/reward_mean" in r] == [0, 3, 6]
