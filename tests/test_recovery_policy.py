"""FailurePolicy, failure classification and the recovery state machine (pure, no Ray)."""

import pytest

from resilient_rl.errors import Cause
from resilient_rl.recovery.causes import Failure, classify
from resilient_rl.recovery.policy import Decision, FailurePolicy
from resilient_rl.recovery.states import ALLOWED, IllegalTransition, RecoveryState, RecoveryStateMachine
from resilient_rl.testing.clock import FakeClock
from resilient_rl.errors import (CollectiveError, ConfigError, WorkerDiedError, WorkerError, WorkerTimeoutError)

S = RecoveryState


def fail(cause="died", role="actor", rank=0, t=0.0):
    return Failure(role, rank, Cause(cause), "boom", t)


def spend(policy, failure, restarted):
    """A failure decided before its restarts, then the restarts spent: the recovery's order."""
    verdict = policy.decide(failure, restarting=restarted)
    return verdict if verdict.decision is Decision.RAISE else policy.record_restarts(restarted)


def test_classify_maps_the_error_tree_to_causes():
    assert classify(WorkerDiedError("x", role="actor", rank=1)).cause == "died"
    assert classify(WorkerDiedError("x", role="actor", rank=1)).rank == 1
    assert classify(WorkerTimeoutError("x", role="critic", rank=0)).cause == "timeout"
    assert classify(CollectiveError("x", role="actor", rank=0)).cause == "collective"
    assert classify(WorkerError("x", role="actor", rank=0, cause="exception")).cause == "exception"
    assert classify(WorkerError("x", role="actor", rank=0, cause="exhausted")).cause == "exhausted"
    assert classify(ConfigError("bad")).cause == "error"
    assert classify(ValueError("bug")).cause == "exception"


def test_recoverable_failures_are_retried_within_budget():
    clock = FakeClock()
    policy = FailurePolicy(max_restarts=2, max_failures=10, failure_window_s=60, clock=clock)
    assert spend(policy, fail(), [("actor", 0)]).decision is Decision.RETRY
    assert spend(policy, fail(), [("actor", 0)]).decision is Decision.RETRY
    verdict = spend(policy, fail(), [("actor", 0)])
    assert verdict.decision is Decision.RAISE
    assert "actor:0 already restarted max_restarts=2 times" in verdict.reason
    assert policy.restarts == {"actor:0": 2}, "a refused restart is not spent"


def test_restarts_nobody_asked_for_spend_the_budget_too():
    policy = FailurePolicy(max_restarts=1, max_failures=10, failure_window_s=60, clock=FakeClock())
    assert spend(policy, fail(rank=0), [("actor", 0), ("actor", 1)]).decision is Decision.RETRY
    verdict = policy.record_restarts([("actor", 1)])  # rank 1 came back once more on its own
    assert verdict.decision is Decision.RAISE and "actor:1 restarted more than max_restarts=1" in verdict.reason


def test_restart_budget_is_per_actor():
    policy = FailurePolicy(max_restarts=1, max_failures=10, failure_window_s=60, clock=FakeClock())
    assert spend(policy, fail(rank=0), [("actor", 0)]).decision is Decision.RETRY
    assert spend(policy, fail(rank=1), [("actor", 1)]).decision is Decision.RETRY
    assert spend(policy, fail(rank=1), [("actor", 1)]).decision is Decision.RAISE


def test_failure_window_budget_slides():
    clock = FakeClock()
    policy = FailurePolicy(max_restarts=100, max_failures=2, failure_window_s=60, clock=clock)
    assert policy.decide(fail()).decision is Decision.RETRY
    clock.now += 10
    assert policy.decide(fail()).decision is Decision.RETRY
    clock.now += 10
    verdict = policy.decide(fail(role="critic", rank=0, cause="timeout"))
    assert verdict.decision is Decision.RAISE and "3 failures within 60s" in verdict.reason
    assert "critic rank 0" in verdict.reason
    clock.now += 120  # older failures leave the window
    assert policy.decide(fail()).decision is Decision.RETRY


@pytest.mark.parametrize("cause", ["exception", "error", "exhausted", "stale_weights"])
def test_non_recoverable_causes_raise_at_once(cause):
    policy = FailurePolicy(max_restarts=5, max_failures=5, failure_window_s=60, clock=FakeClock())
    verdict = policy.decide(fail(cause=cause, role="ref", rank=0))
    assert verdict.decision is Decision.RAISE and "ref rank 0" in verdict.reason and cause in verdict.reason


def test_policy_state_round_trips():
    clock = FakeClock()
    policy = FailurePolicy(max_restarts=5, max_failures=5, failure_window_s=60, clock=clock)
    spend(policy, fail(), [("actor", 1)])
    other = FailurePolicy(max_restarts=5, max_failures=5, failure_window_s=60, clock=clock)
    other.load_state_dict(policy.state_dict())
    assert other.restarts == {"actor:1": 1} and other.total == 1
    assert list(other.recent) == list(policy.recent)
    older = FailurePolicy(max_restarts=5, max_failures=5, failure_window_s=60, clock=clock)
    older.load_state_dict({"restarts": {"actor:1": 2}, "recent": [], "total": 2})  # counts, as saved before
    assert older.restarts == {"actor:1": 2}


def test_the_restart_budget_refills_with_the_window_so_a_failure_a_day_runs_for_weeks():
    """A rank failing once a day is retried every day (a lifetime budget of 3 ended the run on the
    fourth); the same rank failing in a loop still spends its budget within the window."""
    day = 86_400.0
    clock = FakeClock()
    policy = FailurePolicy(max_restarts=3, max_failures=5, failure_window_s=3600, clock=clock)
    for _ in range(14):
        assert spend(policy, fail(), [("actor", 1)]).decision is Decision.RETRY
        clock.now += day
    for _ in range(3):
        assert spend(policy, fail(), [("actor", 1)]).decision is Decision.RETRY
        clock.now += 60
    verdict = spend(policy, fail(), [("actor", 1)])
    assert verdict.decision is Decision.RAISE and "within failure_window_s=3600s" in verdict.reason


def test_a_restarted_controller_keeps_the_spent_budget_and_a_rollback_never_refills_it():
    clock = FakeClock()
    policy = FailurePolicy(max_restarts=5, max_failures=2, failure_window_s=60, clock=clock)
    spend(policy, fail(), [("actor", 1)])
    saved = policy.state_dict()  # what the next checkpoint records
    clock.now += 1
    spend(policy, fail(), [("actor", 1)])
    policy.load_state_dict(saved)  # an in-process recovery restores the older checkpoint
    assert policy.restarts == {"actor:1": 2} and policy.total == 2 and len(policy.recent) == 2
    # A new controller (fresh budget) resumes from the checkpoint: the failure it recorded counts.
    fresh = FailurePolicy(max_restarts=5, max_failures=2, failure_window_s=60, clock=clock)
    fresh.load_state_dict(policy.state_dict())
    clock.now += 1
    assert fresh.decide(fail()).decision is Decision.RAISE  # 3 failures within the window > 2


def test_state_machine_happy_path_and_failure_during_recovery():
    sm = RecoveryStateMachine()
    for s in (S.RECOVERING, S.REJOINING, S.RECOVERING, S.REJOINING, S.RESTORING, S.RUNNING):
        sm.to(s)
    assert sm.state is S.RUNNING and len(sm.history) == 6
    assert [h[2] for h in sm.history][-1] is S.RUNNING


def test_state_machine_rejects_illegal_transitions():
    sm = RecoveryStateMachine()
    with pytest.raises(IllegalTransition, match="running -> restoring"):
        sm.to(S.RESTORING)
    with pytest.raises(IllegalTransition, match="running -> aborting"):  # the policy decides in RECOVERING
        sm.to(S.ABORTING)
    sm.to(S.RECOVERING)
    sm.to(S.ABORTING)
    sm.to(S.FAILED)
    for s in S:
        with pytest.raises(IllegalTransition):
            sm.to(s)


def test_every_recovery_state_can_abort_except_the_end():
    for state, allowed in ALLOWED.items():
        if state not in (S.RUNNING, S.ABORTING, S.FAILED):
            assert S.ABORTING in allowed


def test_the_trainer_checkpoint_carries_the_failure_budget(tmp_path):
    from resilient_rl.config.schema import load_config
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", f"checkpoint.root={tmp_path}/ckpt",
                             "telemetry.enabled=false"])
    trainer = PPOTrainer(cfg, roles_factory=LocalRoles)
    spend(trainer.recovery.policy, fail(), [("actor", 1)])
    state = trainer.state_dict()
    restarted = PPOTrainer(cfg, roles_factory=LocalRoles)  # a new controller on the same run
    restarted.load_state_dict(state)
    assert restarted.recovery.policy.restarts == {"actor:1": 1} and restarted.recovery.policy.total == 1
