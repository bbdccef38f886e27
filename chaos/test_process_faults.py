"""SIGKILL, SIGSTOP and ray.kill of every role; each run must end as if nothing had happened."""

from __future__ import annotations

import pytest

from suite import FSDP, check_restore_point
from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule

# SIGKILL of each role and rank runs with the slow cases (the recovery path is the same code for
# each). The default set kills an actor rank in test_sigkill_of_an_fsdp_rank below,
# chaos/test_snapshot_defaults.py (the rollout too) and chaos/test_spare_faults.py, and the rollout
# in chaos/test_validation_faults.py.
ROLES = [("actor", 0), ("actor", 1), ("critic", 0), ("ref", 0), ("rollout", 0)]


@pytest.mark.slow
@pytest.mark.parametrize("role,rank", ROLES)
def test_sigkill(reference, chaos_run, role, rank):
    # At the very start of step 4, so the dead rank's first call of the step finds it gone.
    schedule = FaultSchedule().at_step(4).kill(role, rank)
    result = chaos_run(schedule)
    check_invariants(result, reference)
    failure = result.events_of("failure")[0]
    assert failure["step"] == 4 and failure["cause"] in ("died", "collective")
    check_restore_point(result.events_of("recovered")[0], 2)


def test_sigkill_of_an_fsdp_rank(fsdp_reference, chaos_run):
    """The same fault with the actor and critic sharded by FSDP2: a survivor's shards and the
    restarted rank's come back as they were (the default on CPU replicates them)."""
    schedule = FaultSchedule().at_step(4).kill("actor", 1)
    result = chaos_run(schedule, *FSDP)
    check_invariants(result, fsdp_reference)
    assert result.events_of("failure")[0]["step"] == 4
    check_restore_point(result.events_of("recovered")[0], 2)


# The critic's case runs by default: its calls end before the first health poll, so its process
# is heard of after its start-up only through the waits asking (runtime/liveness.py); it stood
# at 70 s of recovery (the start-up allowance) before they did. The other cases are slow.
@pytest.mark.parametrize("role,rank", [pytest.param("actor", 1, marks=pytest.mark.slow), ("critic", 0),
                                       pytest.param("ref", 0, marks=pytest.mark.slow),
                                       pytest.param("rollout", 0, marks=pytest.mark.slow)])
def test_sigstop(reference, chaos_run, role, rank):
    """A stopped rank: its health call goes unanswered, it is named hung, killed and restarted."""
    schedule = FaultSchedule().at_step(3).hang(role, rank, delay_s=0.1)
    result = chaos_run(schedule)
    check_invariants(result, reference)
    fault = schedule.faults[0]
    killed = result.events_of("kill_unresponsive")
    assert [e["pid"] for e in killed] == [fault.pid], "the stopped process itself was the one killed"
    assert result.events_of("failure")[0]["cause"] == "hang"


@pytest.mark.slow  # the same recovery as a SIGKILL, through ray.kill
def test_ray_kill_actor(reference, chaos_run):
    schedule = FaultSchedule().at_step(5).ray_kill("actor", 0)
    result = chaos_run(schedule)
    check_invariants(result, reference)
    # Step 4's async save is committed once written: at the start of step 5 or after it.
    check_restore_point(result.events_of("recovered")[0], 2, 4)


def test_sigstop_actor_rank_mid_collective(reference, chaos_run):
    """Rank 0 stops inside the update; rank 1 blocks in the collective but answers health probes."""
    schedule = FaultSchedule().at_step(4).hang("actor", 0, in_call="update_actor")
    result = chaos_run(schedule)
    check_invariants(result, reference)
    assert [e["rank"] for e in result.events_of("kill_unresponsive")] == [0]
