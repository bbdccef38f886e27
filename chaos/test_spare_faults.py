"""Warm spares (recovery.spares): a dead rank is handed to an idle, started process at once.

With snapshots on too (the fast recovery path of a production run), a failure costs neither a
new process nor any replayed step, and the run still ends bit-identical to the fault-free one.
"""

from __future__ import annotations

import pytest

from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule

FAST = ("checkpoint.save_every=20", "recovery.snapshot_every=1", "recovery.spares=1")


def _pids_of(result, kind: str) -> list[int]:
    return [e["pid"] for e in result.events_of(kind)]


def test_sigkill_actor_rank_is_served_by_a_spare(reference, chaos_run):
    # Inside the update: the death is seen at once (the call and its peer's collective fail). A
    # death between calls is seen only by the next call, by when Ray may have restarted the
    # process itself (and recovery rightly takes that one rather than the spare).
    result = chaos_run(FaultSchedule().after_snapshot(4).kill("actor", 1, in_call="update_actor"), *FAST)
    check_invariants(result, reference)
    adopted = result.events_of("spare_adopted")
    assert [(e["role"], e["rank"]) for e in adopted] == [("actor", 1)], adopted
    restarted = result.events_of("worker_restarted")
    assert len(restarted) == 1 and restarted[0]["pid"] != result.schedule.faults[0].pid
    rec = result.events_of("recovered")[0]
    assert (rec["restored_step"], rec["steps_replayed"], rec["source"]) == (3, 0, "snapshot"), rec


@pytest.mark.slow
def test_a_spare_killed_while_taking_over(reference, chaos_run):
    """The spare that became actor rank 1 dies as it restores the rank's state: the rank goes to
    the next process that is ready (the replaced one, once Ray restarted it, or Ray's restart of
    either). (A death during the rendezvous itself leaves the survivors waiting for the rendezvous
    timeout first: ``recovery.rendezvous_timeout_s``.)"""
    schedule = (FaultSchedule().after_snapshot(4).kill("actor", 1, in_call="update_actor")
                .during_recovery("restoring").kill("actor", 1))
    result = chaos_run(schedule, *FAST)
    check_invariants(result, reference)
    assert result.events_of("spare_adopted")[0]["rank"] == 1
    assert result.events_of("failure_during_recovery"), "the spare's death was not seen during recovery"
    # Where the state comes from then depends on what else the second death took down (a
    # survivor blocked in a collective with the dying spare may be killed too): any source will
    # do, the run must end as the fault-free one did.
    assert result.events_of("recovered")[-1]["source"] in ("snapshot", "checkpoint", "start")


@pytest.mark.slow
def test_a_stopped_rank_is_killed_and_served_by_a_spare(reference, chaos_run):
    result = chaos_run(FaultSchedule().after_snapshot(3).hang("critic", 0, in_call="update_critic"), *FAST)
    check_invariants(result, reference)
    assert ("critic", 0) in [(e["role"], e["rank"]) for e in result.events_of("spare_adopted")]
    assert result.events_of("kill_unresponsive") or result.events_of("kill_hung")
