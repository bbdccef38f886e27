"""NaN rewards and NaN losses mid-run: the run finishes, nothing non-finite is committed.

The injectors (:mod:`resilient_rl.faults.nonfinite`) poison every reward of step 2 and one
sample's advantage in step 3 (on actor rank 0 only: the ranks must agree to skip). Under
``trainer.nonfinite=skip`` the rewards score 0 and the poisoned mini-batches are not applied;
under ``rollback`` the run goes back to the newest known-good checkpoint and continues with
the next data. Neither run is compared with the reference: both train on different numbers.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from suite import RESULTS, STEPS, chaos_overrides
from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.faults.harness import leftovers, run_training
from resilient_rl.faults.nonfinite import NonFiniteAdvantage, NonFiniteReward, nonfinite_tensors


def _run(chaos_dir: str, name: str, hooks: tuple, *extra: str):
    result = run_training(chaos_overrides(chaos_dir) + list(extra), name, hooks=hooks)
    RESULTS.append(result)
    return result


def _nonfinite_counts(text: str) -> dict[tuple[str, str], float]:
    """(quantity, action) -> rrl_nonfinite_total from the controller's exposition text.

    Series still at 0 are left out: some are exported from the start so alerts have data.
    """
    return {(s.labels["quantity"], s.labels["action"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "rrl_nonfinite_total" and s.value != 0}


def _check_finished_and_finite(result, chaos_dir: str) -> CheckpointManager:
    assert result.error is None, result.error
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
    assert result.committed and result.latest == result.committed[-1]
    assert all(v == "ok" for v in result.verify.values()), result.verify
    assert nonfinite_tensors(f"{chaos_dir}/ckpt", result.name) == []
    assert not leftovers(result)
    return CheckpointManager(f"{chaos_dir}/ckpt", result.name)


def test_nan_reward_and_nan_loss_are_skipped(chaos_ray, chaos_dir):
    reward, adv = NonFiniteReward(steps=[2]), NonFiniteAdvantage(steps=[3])
    result = _run(chaos_dir, "nonfinite-skip", (reward, adv))
    manager = _check_finished_and_finite(result, chaos_dir)
    assert reward.fired == [2] and adv.fired == [3]
    seen = [(e["step"], e["quantity"], e["role"], e["action"]) for e in result.events_of("nonfinite")]
    assert seen == [(2, "reward", None, "zeroed"), (3, "loss", "actor", "skipped")]
    rows = {r["step"]: r for r in result.history}
    assert rows[2]["reward/nonfinite"] == 16.0 and rows[3]["actor/nonfinite_skipped"] >= 1.0
    assert _nonfinite_counts(result.metrics_text) == {("reward", "zeroed"): 1.0, ("loss", "skipped"): 1.0}
    # steps 2 and 4 closed intervals that met a NaN; step 6's interval was clean
    assert {s: manager.load_manifest(s).known_good for s in result.committed} == {2: False, 4: False, 6: True}


def test_nan_loss_rolls_back_to_the_known_good_checkpoint(chaos_ray, chaos_dir):
    adv = NonFiniteAdvantage(steps=[3])
    result = _run(chaos_dir, "nonfinite-rollback", (adv,), "trainer.nonfinite=rollback")
    manager = _check_finished_and_finite(result, chaos_dir)
    seen = [(e["step"], e["quantity"], e["action"]) for e in result.events_of("nonfinite")]
    assert seen == [(3, "loss", "rolled_back")]
    assert [(e["failed_step"], e["restored_step"]) for e in result.events_of("nonfinite_rollback")] == [(3, 2)]
    assert all(r.get("actor/nonfinite_skipped", 0.0) == 0.0 for r in result.history)  # step 3 was retrained
    assert all(manager.load_manifest(s).known_good for s in result.committed)
    assert _nonfinite_counts(result.metrics_text) == {("loss", "rolled_back"): 1.0}
    # The data moved on past the poisoned batch: 7 batches of 16 out of 64 prompts were drawn for
    # 6 kept steps (without the rollback: epoch 1, position 32).
    assert result.final_trainer_state["loader"]["epoch"] == 1
    assert result.final_trainer_state["loader"]["position"] == 48
