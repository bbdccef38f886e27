"""A rank dies as the weights go from the actor to the rollout over the weight channel.

The channel (``rollout.weight_transfer=channel``: NCCL on GPUs, gloo here) is one collective
across two process groups: actor rank 0 broadcasts each bucket to every rollout rank. When a rank
of one side dies, the other side's ranks are inside the sync with it. Recovery must end their
wait (they are told to leave, or leave on their own where the dead peer's sockets close, as here)
and rejoin their group too: their collectives are left, and the next one would fail on them.
"""

from __future__ import annotations

import pytest

from suite import check_restore_point
from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule

CHANNEL = ("rollout.weight_transfer=channel",)


@pytest.mark.parametrize("role, other", [("rollout", "actor"), pytest.param("actor", "rollout", marks=pytest.mark.slow)])
def test_a_rank_killed_as_the_sync_starts_rejoins_both_sides(reference, chaos_run, role, other):
    schedule = FaultSchedule().at_weight_sync(4).kill(role, 0)
    result = chaos_run(schedule, *CHANNEL)
    check_invariants(result, reference)
    assert result.events_of("failure")[0]["step"] == 4
    (recovered,) = result.events_of("recovered")
    assert recovered["steps_replayed"] == 0
    rejoined = {group.rsplit("_", 1)[-1] for group in recovered["rejoined"]}
    assert {role, other} <= rejoined, f"both sides of the channel join a new generation: {recovered['rejoined']}"
    check_restore_point(recovered, 2)
