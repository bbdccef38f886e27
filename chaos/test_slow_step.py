"""A slow but healthy step is not a hang: no recovery, and the run equals the fault-free one."""

from __future__ import annotations

import pytest

from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule

SLOW_S, ADVANCES, HANG_S = 1.5, 6, 3


@pytest.mark.slow  # in the default set: tests/test_liveness_ray.py, a long call that keeps advancing
def test_slow_actor_rank_is_not_a_hang(reference, chaos_run):
    """Actor rank 1's next mini-batches each take 1.5 s longer: 9 s in all, three times the hang
    timeout and more than the suite's 6 s call ceiling, yet it advances every 1.5 s."""
    schedule = FaultSchedule().at_step(3).slow("actor", 1, seconds_per_advance=SLOW_S, advances=ADVANCES)
    result = chaos_run(schedule, f"recovery.hang_timeout_s={HANG_S}", "recovery.call_timeout_s=120")
    check_invariants(result, reference, expect_recoveries=0)
    assert result.events_of("failure") == [] and result.events_of("recovered") == []
    assert result.events_of("kill_unresponsive") == [] and result.events_of("kill_hung") == []
    fault = schedule.faults[0]
    assert fault.fired and fault.pid is not None
    # The injected sleeps really happened inside the run's steps (a lower bound set by the sleeps).
    assert sum(row["timing/step_s"] for row in result.history if row["step"] >= 3) >= SLOW_S * ADVANCES
