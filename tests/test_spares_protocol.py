"""Warm spares in the recovery protocol (against the scripted pool): a dead rank is handed to a
ready spare instead of waiting for Ray to restart its process."""

from __future__ import annotations

from resilient_rl.testing.fake_pool import FakePool
from test_recovery_protocol import Harness, died


def test_a_dead_rank_is_handed_to_a_ready_spare_not_restarted():
    h = Harness(pool=FakePool(spares=1))
    old = h.pool.known[("main", 1)]
    h.pool.crash("main", 1)
    h.handle(died())
    assert h.kinds() == ["failure", "spare_adopted", "worker_restarted", "recovered"]
    assert h.of("spare_adopted")[0] == {"group": "main", "rank": 1, "role": "actor"}
    ops = h.pool.ops()
    assert ops.index("adopt") < ops.index("wait_alive") < ops.index("rendezvous")
    proc = h.pool.procs[("main", 1)]
    assert proc.restarts == 0 and proc.pid != old.pid and proc.node != old.node_id  # a spare, not Ray's restart
    assert h.of("worker_restarted")[0]["pid"] == proc.pid
    assert h.recovery.policy.restarts == {"actor:1": 1}  # a spare taking over spends the rank's budget


def test_the_replaced_process_refills_the_pool_for_the_next_failure():
    h = Harness(pool=FakePool(spares=1))
    for step in (5, 9):
        h.pool.crash("main", 1)
        h.handle(died(), step=step)
    assert h.kinds().count("spare_adopted") == 2
    assert h.pool.procs[("main", 1)].restarts == 0


def test_more_dead_ranks_than_spares_wait_for_ray_for_the_rest():
    h = Harness(pool=FakePool(spares=1))
    h.pool.crash("main", 0)
    h.pool.crash("main", 1)
    h.handle(died(rank=0))
    assert [e["rank"] for e in h.of("spare_adopted")] == [0]
    assert h.pool.procs[("main", 0)].restarts == 0 and h.pool.procs[("main", 1)].restarts == 1
    assert {(e["group"], e["rank"]) for e in h.of("worker_restarted")} == {("main", 0), ("main", 1)}


def test_a_stopped_rank_is_killed_and_its_place_given_to_a_spare():
    h = Harness(pool=FakePool(spares=1))
    h.pool.stop("main", 0)
    h.handle(died(rank=0))
    assert "kill_unresponsive" in h.kinds() and h.of("spare_adopted")[0]["rank"] == 0
    assert h.pool.procs[("main", 0)].restarts == 0


def test_a_spare_that_dies_taking_over_leaves_the_rank_to_the_next_spare_or_to_ray():
    h = Harness(pool=FakePool(spares=2))
    h.pool.spare_dies = 1
    h.pool.crash("main", 1)
    h.handle(died())
    assert len(h.of("spare_adopted")) == 1 and h.pool.procs[("main", 1)].restarts == 0

    h = Harness(pool=FakePool(spares=1))
    h.pool.spare_dies = 1
    h.pool.crash("main", 1)
    h.handle(died())
    assert "spare_adopted" not in h.kinds() and h.pool.procs[("main", 1)].restarts == 1
    assert h.kinds()[-1] == "recovered"


def test_a_survivor_keeps_its_process_and_no_spare_is_spent_on_it():
    h = Harness(pool=FakePool(groups={"main": ("actor", "rollout"), "critic": ("critic",)}, spares=1))
    kept = {key: info.pid for key, info in h.pool.known.items() if key != ("main", 1)}
    h.pool.crash("main", 1)
    h.handle(died())
    assert [(e["group"], e["rank"]) for e in h.of("spare_adopted")] == [("main", 1)]
    assert {key: h.pool.known[key].pid for key in kept} == kept
    assert h.pool.ready_spares["critic"] == 1


# ---------------------------------------------------------------------------- per-group recovery
def test_only_the_group_that_lost_a_member_rejoins_and_rebuilds():
    pool = FakePool(groups={"actor": ("actor",), "critic": ("critic",), "rollout": ("rollout",)})
    h = Harness(pool=pool)
    pool.crash("rollout", 0)
    h.handle(died(rank=0, group="rollout"))
    assert ("rendezvous", ["rollout"]) in pool.calls and ("init_models", ["rollout"]) in pool.calls


def test_the_group_a_collective_error_names_rejoins_with_the_dead_ranks_group():
    from resilient_rl.errors import CollectiveError

    pool = FakePool(groups={"actor": ("actor",), "critic": ("critic",), "rollout": ("rollout",)})
    h = Harness(pool=pool)
    pool.crash("rollout", 0)  # the actor's weight broadcast broke on it
    h.handle(CollectiveError("actor rank 0: collective failed", role="actor", rank=0, cause="collective"))
    assert ("rendezvous", ["actor", "rollout"]) in pool.calls


def test_a_failure_naming_no_group_rejoins_every_group():
    from resilient_rl.errors import WorkerTimeoutError

    pool = FakePool(groups={"actor": ("actor",), "critic": ("critic",)})
    h = Harness(pool=pool)
    h.handle(WorkerTimeoutError("step ceiling passed", cause="timeout"))
    assert ("rendezvous", ["actor", "critic"]) in pool.calls


def test_groups_to_rejoin_carry_over_a_failure_during_rejoining():
    """The critic rejoined but did not rebuild before the actor's failure: the second attempt
    rebuilds it too (its model is bound to the process group it left)."""
    from resilient_rl.errors import CollectiveError

    pool = FakePool(groups={"actor": ("actor",), "critic": ("critic",)})
    h = Harness(pool=pool)
    pool.fail_next("init_models", CollectiveError("actor rank 1: collective failed", role="actor", rank=1,
                                                  cause="collective"))
    h.handle(CollectiveError("critic rank 0: collective failed", role="critic", rank=0, cause="collective"))
    rejoins = [c[1] for c in pool.calls if c[0] == "rendezvous"]
    assert rejoins == [["critic"], ["actor", "critic"]], rejoins
    assert h.kinds()[-1] == "recovered"
