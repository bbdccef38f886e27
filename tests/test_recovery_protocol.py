"""The recovery protocol against a scripted pool and a fake clock: no Ray, milliseconds per case."""

from __future__ import annotations

import pytest

from resilient_rl.config.runtime import RecoveryConfig
from resilient_rl.recovery.states import RecoveryState
from resilient_rl.errors import (CollectiveError, LeaseError, NoCapacityError, Preempted, RecoveryError, StorageError,
                                 WorkerDiedError, WorkerError, WorkerTimeoutError)
from resilient_rl.testing.clock import FakeClock
from resilient_rl.testing.fake_pool import FakePool
from resilient_rl.recovery.driver import Recovery

S = RecoveryState


class Checkpoints:
    def __init__(self, last_committed=4):
        self.last_committed = last_committed
        self.abandoned = 0

    def abandon(self, reason: str = "recovery") -> None:
        self.abandoned += 1


class Harness:
    """A Recovery wired to a FakePool, recording events, states entered (their ``recovery_state``
    events, kept apart from the others) and restores."""

    def __init__(self, pool: FakePool | None = None, restore=None, **recovery):
        self.pool = pool or FakePool()
        self.clock = FakeClock()
        self.wall = FakeClock(start=1.7e9)
        self.events: list[tuple[str, dict]] = []
        self.states: list[RecoveryState] = []
        self.ckpt = Checkpoints()
        self.restores = 0
        self._restore = restore
        cfg = RecoveryConfig(**{"max_restarts": 3, "max_failures": 5, "failure_window_s": 3600.0, **recovery})
        self.source = None  # where the roll-back went (a scripted restore names none)
        self.recovery = Recovery(cfg, checkpoints=self.ckpt, rollback=self,
                                 emit=self._emit,
                                 clock=self.clock, sleep=self.clock.sleep, wall_clock=self.wall)

    def _emit(self, kind: str, **fields) -> None:
        if kind == "recovery_state":
            self.states.append(RecoveryState(fields["state"]))
        else:
            self.events.append((kind, fields))

    def roll_back_to(self, roles, *points) -> int:
        assert roles is self.pool
        self.points = points
        self.restores += 1
        if self._restore is not None:
            return self._restore()
        return self.ckpt.last_committed

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]

    def of(self, kind: str) -> list[dict]:
        return [f for k, f in self.events if k == kind]

    def handle(self, exc: BaseException, step: int = 7) -> None:
        self.recovery.handle(exc, step, self.pool)

    def path(self) -> list[RecoveryState]:
        return [to for _, _, to in self.recovery.sm.history]


def died(rank=1, group="main:actor"):
    return WorkerDiedError(f"{group} rank {rank} died", role=group, rank=rank)


def test_a_dead_rank_is_restarted_rejoined_and_restored():
    h = Harness()
    old_pid = h.pool.known[("main", 1)].pid
    h.pool.crash("main", 1)
    h.handle(died())
    assert h.kinds() == ["failure", "worker_restarted", "recovered"]
    failure = h.of("failure")[0]
    assert (failure["role"], failure["group"], failure["rank"], failure["cause"]) == ("actor", "main", 1, "died")
    restarted = h.of("worker_restarted")[0]
    assert (restarted["group"], restarted["rank"], restarted["role"]) == ("main", 1, "actor")
    assert restarted["pid"] != old_pid and h.pool.known[("main", 1)].pid == restarted["pid"]
    recovered = dict(h.of("recovered")[0])
    phases = recovered.pop("phases")
    assert recovered == {"failed_step": 7, "restored_step": 4, "steps_replayed": 2, "duration_s": 0.0,
                         "restarted": [["main", 1]], "rejoined": ["main"], "generation": 2, "source": None}
    assert set(phases) == {"detect", "restart", "rejoin", "restore"} and phases["restart"] == 0.0
    assert h.path() == [S.RECOVERING, S.REJOINING, S.RESTORING, S.RUNNING]
    assert h.states == [S.RECOVERING, S.REJOINING, S.RESTORING]
    assert h.ckpt.abandoned == 1 and h.restores == 1
    assert h.pool.empty_inits == [True]  # models rebuilt empty: the restore fills them
    assert h.recovery.policy.restarts == {"actor:1": 1}
    assert "kill" not in h.pool.ops()  # nothing to kill: the process was already gone



def test_every_state_a_recovery_enters_is_an_event_also_when_it_aborts():
    h = Harness(enabled=False)
    with pytest.raises(RecoveryError):
        h.handle(died())
    assert h.states == [S.RECOVERING, S.ABORTING] and h.kinds() == ["failure", "aborted"]

def test_a_stopped_rank_is_killed_then_restarted():
    h = Harness()
    h.pool.stop("main", 0)
    h.handle(CollectiveError("gloo: peer 0 timed out", role="main:actor", rank=1))
    assert h.kinds() == ["failure", "kill_unresponsive", "worker_restarted", "recovered"]
    assert h.of("kill_unresponsive")[0]["rank"] == 0 and ("kill", ("main", 0)) in h.pool.calls
    assert h.of("failure")[0]["cause"] == "collective"


def test_a_survivor_still_importing_at_start_is_waited_for_not_killed():
    # Its start-up imports hold the interpreter: its health answers come late, not never.
    h = Harness(warmup_timeout_s=30.0)
    h.pool.crash("main", 1)
    h.pool.warm_up("main", 0, silent_probes=3)
    h.handle(died())
    assert h.of("kill_unresponsive") == [] and [e["rank"] for e in h.of("worker_restarted")] == [1]
    assert 0.0 < h.clock.now - 1000.0 < 30.0


def test_a_survivor_that_never_ends_its_warm_up_is_killed_after_warmup_timeout_s():
    h = Harness(warmup_timeout_s=30.0)
    h.pool.crash("main", 1)
    h.pool.warm_up("main", 0)
    h.handle(died())
    assert [e["rank"] for e in h.of("kill_unresponsive")] == [0]
    assert sorted(e["rank"] for e in h.of("worker_restarted")) == [0, 1]
    assert h.clock.now - 1000.0 >= 30.0


def test_a_rank_named_as_hung_is_killed_although_it_answers_the_probe():
    h = Harness()
    pid = h.pool.known[("main", 1)].pid
    h.handle(WorkerTimeoutError("main:actor rank 1 is hung", role="main:actor", rank=1, cause="hang", pid=pid))
    assert h.of("kill_hung")[0]["rank"] == 1 and h.of("failure")[0]["cause"] == "hang"
    assert [e["rank"] for e in h.of("worker_restarted")] == [1]


def test_a_hang_naming_an_already_replaced_process_kills_nothing():
    h = Harness()
    h.handle(WorkerTimeoutError("hung", role="main:actor", rank=1, cause="hang", pid=12345))
    assert "kill" not in h.pool.ops() and h.kinds() == ["failure", "recovered"]


def test_a_survivor_stuck_in_a_call_without_progress_is_killed_while_draining():
    h = Harness(hang_timeout_s=30.0)
    h.pool.crash("main", 1)
    h.pool.busy("main", 0, "update_actor", progress_age_s=45.0)
    h.handle(died())
    assert [(e["rank"], e["reason"]) for e in h.of("kill_hung")] == [
        (0, "inside 'update_actor' without progress for 45.0s")]
    assert sorted(e["rank"] for e in h.of("worker_restarted")) == [0, 1]


def test_a_survivor_of_the_broken_group_is_told_to_leave_its_collectives_not_killed():
    h = Harness(hang_timeout_s=30.0, restart_timeout_s=5.0)
    h.pool.crash("main", 1)
    h.pool.busy("main", 0, "update_actor", progress_age_s=1.0)
    h.handle(died())
    assert h.of("kill_hung") == []
    assert h.of("leave_collectives") == [{"ranks": [["main", 0]]}]
    assert ("leave_collectives", (("main", 0),)) in h.pool.calls
    assert h.clock.now - 1000.0 < 1.0  # its call ended: no wait for the drain deadline
    assert [e["rank"] for e in h.of("worker_restarted")] == [1]


def test_a_survivor_of_another_group_still_advancing_is_waited_for_not_told_to_leave():
    pool = FakePool(groups={"actor": ("actor",), "rollout": ("rollout",)})
    h = Harness(pool, hang_timeout_s=30.0, restart_timeout_s=5.0)
    pool.crash("actor", 1)
    pool.busy("rollout", 0, "generate_sequences", progress_age_s=1.0)
    h.handle(died(group="actor"))
    assert h.of("kill_hung") == [] and h.of("leave_collectives") == []
    assert h.clock.now - 1000.0 >= 5.0  # waited out the drain deadline
    assert [(e["group"], e["rank"]) for e in h.of("worker_restarted")] == [("actor", 1)]


SYNC = {"actor": frozenset({"send_weights"}), "rollout": frozenset({"receive_weights"})}


def split_pool() -> FakePool:
    """The split placement with a weight channel: the actor's group and the rollout's share the sync."""
    return FakePool(groups={"actor": ("actor",), "rollout": ("rollout",)}, shared_calls=SYNC)


@pytest.mark.parametrize("dead, survivor, call", [("rollout", "actor", "send_weights"),
                                                   ("actor", "rollout", "receive_weights")])
def test_a_survivor_inside_a_sync_with_a_dead_rank_of_the_other_group_leaves_and_its_group_rejoins(dead, survivor,
                                                                                                  call):
    """A rank dies mid-sync: the other group's ranks inside the sync wait on it in the weight
    channel (NCCL within a node never learns of the death). They are told to leave, not waited
    for until the channel's timeout, and their group rejoins (its collectives are left)."""
    pool = split_pool()
    h = Harness(pool, hang_timeout_s=300.0, restart_timeout_s=120.0)
    pool.crash(dead, 1)
    pool.busy(survivor, 0, call, progress_age_s=1.0)
    pool.busy(survivor, 1, call, progress_age_s=1.0)
    h.handle(died(group=dead))
    assert h.of("leave_collectives") == [{"ranks": [[survivor, 0], [survivor, 1]]}]
    assert h.clock.now - 1000.0 < 1.0, "no wait for the channel's timeout"
    assert [(e["group"], e["rank"]) for e in h.of("worker_restarted")] == [(dead, 1)]
    assert ("rendezvous", sorted([dead, survivor])) in pool.calls
    assert h.of("recovered")[0]["rejoined"] == sorted([dead, survivor])


def test_a_rank_the_drain_kills_cuts_off_the_other_side_of_its_sync_too():
    """The critic dies while a sync runs, and the rollout rank inside it has stopped advancing: the
    drain kills it as hung, and actor rank 0, waiting on it in the channel, is told to leave then."""
    pool = FakePool(groups={"actor": ("actor",), "rollout": ("rollout",), "critic": ("critic",)},
                    shared_calls=SYNC, world_size=1)
    h = Harness(pool, hang_timeout_s=30.0, restart_timeout_s=120.0)
    pool.crash("critic", 0)
    pool.busy("rollout", 0, "receive_weights", progress_age_s=45.0)
    pool.busy("actor", 0, "send_weights", progress_age_s=1.0)
    h.handle(died(group="critic", rank=0))
    assert [(e["group"], e["rank"]) for e in h.of("kill_hung")] == [("rollout", 0)]
    assert h.of("leave_collectives") == [{"ranks": [["actor", 0]]}]
    assert h.clock.now - 1000.0 < 1.0, "no wait for the channel's timeout"
    assert h.of("recovered")[0]["rejoined"] == ["actor", "critic", "rollout"]


def test_a_survivor_of_another_group_outside_the_sync_is_not_told_to_leave():
    """Only the calls inside the shared collective are cut off: an actor rank in its update when a
    rollout rank dies waits on its own group's live ranks, and its group keeps its process group."""
    pool = split_pool()
    h = Harness(pool, hang_timeout_s=300.0, restart_timeout_s=5.0)
    pool.crash("rollout", 0)
    pool.busy("actor", 0, "update_actor", progress_age_s=1.0)
    h.handle(died(group="rollout", rank=0))
    assert h.of("leave_collectives") == []
    assert ("rendezvous", ["rollout"]) in pool.calls


def test_without_a_shared_collective_the_other_group_s_sync_is_waited_for():
    """Colocated, or the weights through Ray's object store: no collective spans the groups."""
    pool = FakePool(groups={"actor": ("actor",), "rollout": ("rollout",)})
    h = Harness(pool, hang_timeout_s=300.0, restart_timeout_s=5.0)
    pool.crash("rollout", 0)
    pool.busy("actor", 0, "send_weights", progress_age_s=1.0)
    h.handle(died(group="rollout", rank=0))
    assert h.of("leave_collectives") == []
    assert h.clock.now - 1000.0 >= 5.0


def test_a_group_whose_rank_left_its_collectives_on_its_own_rejoins():
    """Across nodes the sync's survivors hear of the death themselves (the channel's sockets close)
    and leave their collectives before recovery asks: their group still rejoins, or its next
    collective would fail again on the connections it shut down."""
    pool = split_pool()
    h = Harness(pool)
    pool.crash("rollout", 0)
    pool.leave("actor", 0)
    h.handle(died(group="rollout", rank=0))
    assert h.of("leave_collectives") == []
    assert ("rendezvous", ["actor", "rollout"]) in pool.calls
    assert not any(p.left for p in pool.procs.values()), "joined again"


def test_a_rank_that_dies_after_answering_is_counted_restarted_and_its_group_rejoins():
    """A node is lost: the critic's rank there is found dead, while the actor's rank there still
    answers (its process notices its node is gone a moment later), then dies and is restarted by
    Ray while the critic is waited for. Its new process has no process group: the actor's group
    must rejoin too, not only the critic's."""
    pool = FakePool(groups={"actor": ("actor",), "critic": ("critic",)})
    h = Harness(pool)
    pool.crash("critic", 0)
    pool.die_late("actor", 1)
    h.handle(died(group="critic", rank=0))
    assert [(e["group"], e["rank"]) for e in h.of("worker_restarted")] == [("actor", 1), ("critic", 0)]
    assert ("rendezvous", ["actor", "critic"]) in pool.calls
    assert h.of("recovered")[0]["restarted"] == [["actor", 1], ["critic", 0]]


@pytest.mark.parametrize("operation, state", [("wait_alive", "recovering"), ("rendezvous", "rejoining"),
                                              ("init_models", "rejoining")])
def test_a_failure_inside_a_state_goes_back_to_recovering_and_spends_the_budget(operation, state):
    h = Harness()
    h.pool.crash("main", 1)
    h.pool.fail_next(operation, CollectiveError(f"{operation} broke", role="main:actor", rank=0))
    h.handle(died())
    during = h.of("failure_during_recovery")
    assert [(e["state"], e["cause"], e["role"]) for e in during] == [(state, "collective", "actor")]
    assert h.kinds()[-1] == "recovered" and h.recovery.policy.total == 2
    assert h.path()[-1] is S.RUNNING and S.RECOVERING in h.path()[1:]


def test_a_failure_while_restoring_recovers_again():
    outcomes = [StorageError("storage read failed: still failing", outage=True)]

    def restore():
        if outcomes:
            raise outcomes.pop(0)
        return 2

    h = Harness(restore=restore)
    h.pool.crash("main", 0)
    h.handle(died(rank=0))
    assert [(e["state"], e["cause"]) for e in h.of("failure_during_recovery")] == [("restoring", "storage")]
    assert h.of("recovered")[0]["restored_step"] == 2 and h.restores == 2


def test_the_policy_refuses_before_anything_is_killed_or_waited_for():
    h = Harness(max_restarts=1)
    h.pool.crash("main", 1)
    h.handle(died())
    h.pool.calls.clear()
    h.pool.crash("main", 1)
    with pytest.raises(RecoveryError, match="actor:1 already restarted max_restarts=1 times"):
        h.handle(died(), step=9)
    assert set(h.pool.ops()) == {"probe"}  # no kill, no wait, no rendezvous
    assert h.of("aborted")[-1]["last_committed_step"] == 4
    assert h.recovery.sm.state is S.FAILED


def test_a_non_recoverable_error_aborts_at_once():
    h = Harness()
    with pytest.raises(RecoveryError, match=r"non-recoverable error \(exception\)"):
        h.handle(WorkerError("main:actor raised ValueError: bug", role="main:actor", rank=0, cause="exception"))
    assert h.kinds() == ["failure", "aborted"] and "rendezvous" not in h.pool.ops()


def test_an_error_racing_ahead_of_a_death_is_handled_as_the_death():
    h = Harness()
    h.pool.crash("main", 1)
    h.handle(WorkerError("main:ref raised RuntimeError: connection reset", role="main:ref", rank=0,
                         cause="exception"))
    assert h.kinds()[-1] == "recovered"
    assert [e["rank"] for e in h.of("worker_restarted")] == [1]


def test_too_many_failures_in_the_window_abort():
    h = Harness(max_failures=1, failure_window_s=60.0)
    h.pool.crash("main", 0)
    h.handle(died(rank=0))
    h.wall.sleep(30.0)
    h.pool.crash("main", 1)
    with pytest.raises(RecoveryError, match="2 failures within 60s exceed max_failures=1"):
        h.handle(died(rank=1))
    h2 = Harness(max_failures=1, failure_window_s=60.0)
    h2.pool.crash("main", 0)
    h2.handle(died(rank=0))
    h2.wall.sleep(61.0)  # the first failure has left the window
    h2.pool.crash("main", 1)
    h2.handle(died(rank=1))
    assert h2.recovery.recoveries == 2


def test_ray_out_of_restarts_ends_the_run_with_the_rank_named():
    pool = FakePool(ray_max_restarts=0)
    h = Harness(pool=pool, max_failures=2)
    pool.crash("main", 1)
    with pytest.raises(RecoveryError) as info:
        h.handle(died())
    assert "main rank 1" in str(info.value) or "actor rank 1" in str(info.value)
    assert [e["cause"] for e in h.of("failure_during_recovery")] == ["exhausted"]


def test_node_loss_restarts_every_rank_of_the_node_elsewhere():
    pool = FakePool(groups={"main": ("actor", "rollout"), "critic": ("critic",)}, world_size=2)
    h = Harness(pool=pool)
    pool.lose_node("node-b")  # rank 1 of both groups
    h.handle(WorkerError("node gone", role="critic", rank=1, cause="node_lost"))
    restarted = {(e["group"], e["rank"]): e["node"] for e in h.of("worker_restarted")}
    assert restarted == {("main", 1): "node-a", ("critic", 1): "node-a"}
    assert h.of("failure")[0]["role"] == "critic" and h.of("failure")[0]["cause"] == "node_lost"
    assert h.recovery.policy.restarts == {"actor:1": 1, "critic:1": 1}


def test_recovery_disabled_aborts_with_the_reason():
    h = Harness(enabled=False)
    h.pool.crash("main", 1)
    with pytest.raises(RecoveryError, match="recovery is disabled"):
        h.handle(died())
    assert "wait_alive" not in h.pool.ops()


def test_a_lease_lost_during_recovery_is_not_recovered_from():
    def restore():
        raise LeaseError("run taken over by controller 2")

    h = Harness(restore=restore)
    h.pool.crash("main", 1)
    with pytest.raises(LeaseError):
        h.handle(died())
    assert "recovered" not in h.kinds()


def test_a_preemption_signal_landing_during_the_probe_stops_the_recovery_before_its_next_call():
    """A job-wide signal took the workers down, and reaches the controller once it is recovering:
    the controller's interrupt then raises, before any call that would need Ray's control plane
    (gone with the job: such a call blocks until Ray ends the process). Nothing is restarted,
    rejoined or restored."""
    h = Harness()
    h.pool.crash("main", 1)
    signalled = []
    probe = h.pool.probe

    def probe_then_signal(*args, **kwargs):
        signalled.append(True)
        return probe(*args, **kwargs)

    def interrupt():
        if signalled:
            raise Preempted("preempted by SIGTERM while recovering step 7", signal_name="SIGTERM", step=6, committed=4)

    h.pool.probe, h.pool.interrupt = probe_then_signal, interrupt
    with pytest.raises(Preempted, match="while recovering step 7"):
        h.handle(died())
    assert h.pool.ops() == ["probe"] and h.states == [S.RECOVERING] and h.restores == 0
    assert "recovered" not in h.kinds()


def test_the_recovered_event_splits_the_recovery_into_its_phases():
    """detect: from the hang's start (stalled_s before it was judged) to recovery; restart, rejoin,
    restore: the time in each state, a failure inside recovery re-entering RECOVERING included."""
    import time

    h = Harness()
    pool = h.pool
    rendezvous, restores = pool.rendezvous, []

    def slow_rendezvous(groups=None):
        h.clock.advance(2.0)
        rendezvous(groups)
        if len(restores) == 0 and not getattr(slow_rendezvous, "failed", False):
            slow_rendezvous.failed = True
            raise CollectiveError("rendezvous broke", role="main:actor", rank=0)

    def slow_restore():
        h.clock.advance(3.0)
        restores.append(1)
        return 4

    pool.rendezvous = slow_rendezvous
    h._restore = slow_restore
    pool.crash("main", 1)
    exc = WorkerTimeoutError("main:actor rank 1 is hung", role="main:actor", rank=1, cause="hang", stalled_s=30.0)
    exc.raised_at = time.monotonic() - 1.0  # learnt of a second before recovery started
    h.handle(exc)
    phases = h.of("recovered")[0]["phases"]
    assert 31.0 <= phases["detect"] < 31.0 + 60.0
    assert phases["rejoin"] == 4.0 and phases["restore"] == 3.0  # two rejoins of 2 s, one restore of 3 s
    # The fake pool restarts at once; recovering again after the failed rejoin first backs off 1 s.
    assert phases["restart"] == 1.0
    assert h.path() == [S.RECOVERING, S.REJOINING, S.RECOVERING, S.REJOINING, S.RESTORING, S.RUNNING]


def test_no_capacity_for_a_lost_node_stops_at_once_without_spending_the_budget():
    h = Harness()
    h.pool.lose_node("node-b")
    h.pool.fail_next("wait_alive", NoCapacityError("actor ranks [1] were lost with node node-b and no alive node "
                                                   "can take them"))
    with pytest.raises(NoCapacityError, match="node-b.*last committed checkpoint is step"):
        h.handle(died())
    aborted = h.of("aborted")
    assert len(aborted) == 1 and "no alive node" in aborted[0]["reason"]
    assert h.of("failure_during_recovery") == [] and h.recovery.policy.total == 1
    assert h.path()[-1] is S.FAILED


def test_a_preemption_signal_during_the_drain_stops_the_recovery_without_waiting_for_the_survivor():
    """A survivor of another group keeps advancing in its call, so the drain waits for it (up to
    ``restart_timeout_s``); a preemption signal landing meanwhile ends the recovery at its next
    probe, within the scheduler's grace period, not at the drain's deadline."""
    pool = FakePool(groups={"actor": ("actor",), "rollout": ("rollout",)})
    h = Harness(pool, hang_timeout_s=300.0, restart_timeout_s=120.0)
    pool.crash("actor", 1)
    pool.busy("rollout", 0, "generate_sequences", progress_age_s=1.0)
    signal_at = h.clock.now + 3.0

    def interrupt():
        if h.clock.now >= signal_at:
            raise Preempted("preempted by SIGTERM while recovering step 7", signal_name="SIGTERM", step=6, committed=4)

    pool.interrupt = interrupt
    with pytest.raises(Preempted, match="while recovering step 7"):
        h.handle(died(group="actor"))
    assert h.clock.now - signal_at < 1.0, "the drain went on waiting after the signal"
    assert "wait_alive" not in pool.ops() and h.restores == 0


def test_failures_in_a_row_back_off_doubling_and_a_completed_step_resets_the_row():
    """The replayed step failing again, or a failure inside the recovery, is a failure in a row:
    the recovery waits before acting (1 s, 2 s, 4 s ... from ``backoff_s``); the first failure,
    and one after a step past the last failed one completed, is recovered from at once."""
    h = Harness(backoff_s=1.0, max_failures=10, max_restarts=10)

    def waits(step: int) -> float:
        h.pool.crash("main", 1)
        before = h.clock.now
        h.handle(died(), step=step)
        return h.clock.now - before

    assert waits(7) == 0.0
    assert waits(7) == 1.0 and waits(6) == 2.0 and waits(7) == 4.0  # the replay failed again each time
    assert waits(8) == 0.0  # step 7 completed since
    assert [(e["in_a_row"], e["wait_s"]) for e in h.of("recovery_backoff")] == [(2, 1.0), (3, 2.0), (4, 4.0)]
    h.pool.crash("main", 1)
    h.pool.fail_next("rendezvous", CollectiveError("rendezvous broke", role="main:actor", rank=0))
    h.handle(died(), step=9)
    assert h.of("recovery_backoff")[-1] == {"in_a_row": 2, "wait_s": 1.0}  # the failure inside the recovery


def test_the_backoff_is_capped_off_with_zero_and_skipped_for_a_failure_no_replay_fixes():
    h = Harness(backoff_s=10.0, max_failures=50, max_restarts=50)
    for _ in range(6):
        h.pool.crash("main", 1)
        h.handle(died(), step=7)
    assert [e["wait_s"] for e in h.of("recovery_backoff")] == [10.0, 20.0, 40.0, 60.0, 60.0]
    with pytest.raises(RecoveryError, match="non-recoverable"):
        h.handle(WorkerError("main:actor raised ValueError: bug", role="main:actor", rank=0, cause="exception"),
                 step=7)
    assert len(h.of("recovery_backoff")) == 5  # not waited for: it aborts at once
    off = Harness(backoff_s=0.0)
    for _ in range(3):
        off.pool.crash("main", 1)
        off.handle(died(), step=7)
    assert off.of("recovery_backoff") == [] and off.clock.now == 1000.0


def test_a_preemption_signal_during_the_backoff_stops_the_recovery():
    h = Harness(backoff_s=30.0)
    h.pool.crash("main", 1)
    h.handle(died(), step=7)
    signal_at = h.clock.now + 2.0

    def interrupt():
        if h.clock.now >= signal_at:
            raise Preempted("preempted by SIGTERM while recovering step 7", signal_name="SIGTERM", step=6, committed=4)

    h.pool.interrupt = interrupt
    h.pool.crash("main", 1)
    with pytest.raises(Preempted):
        h.handle(died(), step=7)
    assert h.clock.now - signal_at <= 0.5, "the backoff went on after the signal"


def test_a_failure_while_a_run_resumes_recovers_to_the_point_it_was_resuming_to():
    """A rank dies while a resumed run loads its checkpoint (``checkpoint.resume=path:``): the
    recovery repairs the pool and loads that same checkpoint, not the run's own newest or a
    snapshot; an ordinary failure rolls back to the newest snapshot, checkpoint or the start."""
    from resilient_rl.recovery.rollback import AFTER_FAILURE, checkpoint

    h = Harness()
    h.pool.crash("main", 1)
    h.handle(died(), step=7)
    assert h.points == AFTER_FAILURE
    resume_to = (checkpoint("path:/ckpt/other/step_00000004"),)
    outages = [StorageError("storage read failed: still failing", outage=True)]
    tried = []

    def restore():
        tried.append(h.points)
        if outages:
            raise outages.pop(0)  # a failure inside the recovery: the next try goes to the same point
        return 4

    h = Harness(restore=restore)
    h.pool.crash("main", 0)
    h.recovery.handle(died(rank=0), 0, h.pool, points=resume_to)
    assert tried == [resume_to, resume_to] and h.of("recovered")[-1]["steps_replayed"] == 0
