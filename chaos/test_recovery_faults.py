"""Failures during recovery, mixed schedules, an exhausted budget and a randomised soak."""

from __future__ import annotations

import os
import random

import pytest

from resilient_rl.errors import RecoveryError
from resilient_rl.faults.harness import check_invariants, leftovers
from resilient_rl.faults.injectors import FaultSchedule


@pytest.mark.parametrize("state,role,rank", [("rejoining", "actor", 0),
                                              pytest.param("restoring", "critic", 0, marks=pytest.mark.slow)])
def test_second_kill_during_recovery(reference, chaos_run, state, role, rank):
    """A survivor dies while the group rendezvous (rejoining) or while state is restored."""
    schedule = FaultSchedule().at_step(4).kill("actor", 1, delay_s=0.05).during_recovery(state).kill(role, rank)
    result = chaos_run(schedule)
    check_invariants(result, reference)
    assert len(result.events_of("failure_during_recovery")) >= 1


@pytest.mark.slow  # its faults each run alone in the default set
def test_mixed_schedule(reference, chaos_run):
    # A delayed hang can land in the step after its own, and two faults in one step make one
    # recovery: the Ray kill comes three steps after the hang.
    schedule = (FaultSchedule().at_step(2).kill("critic", 0)
                .at_step(3).hang("actor", 0, delay_s=0.05)
                .at_step(6).ray_kill("rollout", 0))
    result = chaos_run(schedule)
    check_invariants(result, reference, expect_recoveries=3)


@pytest.mark.slow  # the budget's arithmetic runs against a scripted pool in tests/test_recovery_protocol.py
def test_budget_exhausted_stops_with_a_report(reference, chaos_run):
    """Ray may restart actor rank 1 once; the second death ends the run naming it."""
    schedule = FaultSchedule().at_step(2).kill("actor", 1).at_step(4).kill("actor", 1)
    result = chaos_run(schedule, "recovery.max_restarts=1")
    assert isinstance(result.error, RecoveryError), result.error
    assert "actor:1" in str(result.error)  # the budget named: role and rank
    assert result.committed and result.latest == result.committed[-1]
    assert all(v == "ok" for v in result.verify.values())
    assert result.events_of("aborted")
    assert not leftovers(result)


@pytest.mark.slow
def test_randomised_soak(reference, chaos_run):
    seed = int(os.environ.get("RRL_CHAOS_SEED") or random.SystemRandom().randrange(1 << 30))
    os.environ["RRL_CHAOS_SEED"] = str(seed)
    print(f"chaos soak seed: {seed} (replay with RRL_CHAOS_SEED={seed})")
    # Delays under the 0.05 s the suite's steps take on a 2-core laptop: a fault of the last step
    # must fire before the run ends.
    schedule = FaultSchedule.random(seed, steps=6, n_faults=3, roles=["actor", "critic", "ref", "rollout"],
                                    world_sizes={"actor": 2, "critic": 1, "ref": 1, "rollout": 1}, max_delay_s=0.03)
    result = chaos_run(schedule, name=f"soak-{seed}")
    check_invariants(result, reference, expect_recoveries=1)
