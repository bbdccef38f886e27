"""Warm spares on a local CPU Ray cluster: a spare takes a dead rank's identity and place, the
process it replaced comes back as a spare, and a colocated run recovers through one."""

from __future__ import annotations

import os
import signal
import socket
import types

import pytest
import ray

from resilient_rl.runtime.health import dead_for_good
from resilient_rl.runtime.resource_pool import RayResourcePool
from resilient_rl.runtime.spares import SparePool
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.testing.wait import wait_until
from resilient_rl.run.folder import deterministic_view
from test_controller_ray import make_group
from test_trainer_ray import small_cfg
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.runtime import health
from resilient_rl.runtime.worker_group_spares import reidentify

pytestmark = pytest.mark.ray


def test_a_spare_becomes_the_dead_rank_and_the_replaced_process_a_spare(ray_cluster):
    wg = make_group(2, "spares", max_restarts=2, call_timeout_s=60)
    pool = SparePool(wg, 1, timeout_s=30)
    try:
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the spare to start")
        spare_pid = ray.get(pool._spares[0].handle.ping.remote()).pid
        wg.init_process_group(generation=1, backend="gloo", timeout_s=20)
        victim = wg.ping()[1].pid
        os.kill(victim, signal.SIGKILL)
        info = pool.adopt(1)
        assert info is not None and info.pid == spare_pid and info.rank == 1 and info.world_size == 2
        described = wg.describe("after")
        assert [d["rank"] for d in described] == [0, 1] and described[1]["pid"] == spare_pid
        # Ray restarts the replaced process (it kept rank 1's constructor arguments): a spare once it answers.
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the replaced process to come back as a spare")
        assert ray.get(pool._spares[0].handle.ping.remote()).pid not in (victim, spare_pid)
        wg.init_process_group(generation=2, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
        # The spare, now rank 1, dies with no spare ready: Ray restarts it with a spare's
        # constructor arguments (rank 0's identity) and the group gives it rank 1's back.
        for s in list(pool._spares):
            ray.kill(s.handle, no_restart=True)
        os.kill(spare_pid, signal.SIGKILL)
        infos = wait_until(lambda: health.wait_alive(wg, 30), 60, 0.5, "the spare to be restarted")
        assert infos[1].pid != spare_pid and infos[1].rank == 0, "restarted under the spare's arguments"
        assert [i.rank for i in reidentify(wg, infos)] == [0, 1] and [i.rank for i in wg.ping()] == [0, 1]
        wg.init_process_group(generation=3, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
    finally:
        pool.shutdown()
        wg.shutdown()


def test_a_node_answers_while_its_raylet_accepts_connections(ray_cluster, monkeypatch):
    from resilient_rl.runtime import health

    me = ray.get_runtime_context().get_node_id()
    assert health.node_answers(me) and not health.node_answers("ff" * 28)
    with socket.socket() as s:  # a port nothing listens on: the raylet of a killed node
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    nodes = ray.nodes()
    monkeypatch.setattr(health.ray, "nodes", lambda: [{**n, "NodeManagerAddress": "127.0.0.1",
                                                       "NodeManagerPort": closed} for n in nodes])
    assert not health.node_answers(me)


def test_spares_on_a_node_that_no_longer_answers_are_not_adopted(ray_cluster, monkeypatch):
    """The node of the dead rank is being lost: its spare answered its last ping, but would die
    with the node while taking over; the rank waits for Ray's restart elsewhere instead."""
    from resilient_rl.runtime import spares

    wg = make_group(1, "lostnode", max_restarts=1, call_timeout_s=60)
    pool = SparePool(wg, 1, timeout_s=30)
    try:
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the spare to start")
        wg.ping()
        asked = []
        monkeypatch.setattr(spares, "node_answers", lambda node: asked.append(node) or False)
        handles = list(wg.workers)
        assert pool.adopt(0) is None and wg.workers == handles and len(pool.ready()) == 1
        assert asked == [wg.ranks.placement(0)[0]]
        monkeypatch.setattr(spares, "node_answers", lambda node: True)
        assert pool.adopt(0) is not None and wg.workers != handles
    finally:
        pool.shutdown()
        wg.shutdown()


def test_a_spare_gone_for_good_is_replaced_and_none_ready_leaves_the_rank_alone(ray_cluster):
    wg = make_group(2, "nospare", max_restarts=1, call_timeout_s=60)
    pool = SparePool(wg, 1, timeout_s=30)
    try:
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the spare to start")
        first = pool._spares[0].handle
        ray.kill(first, no_restart=True)  # gone for good
        wait_until(lambda: pool.ready() is not None and pool._spares[0].handle is not first, 30, 0.2,
                   "a fresh spare to be started")
        handles = list(wg.workers)
        assert pool.adopt(0) is None and wg.workers == handles  # the fresh one is still starting
        assert len(pool) == 1
    finally:
        pool.shutdown()
        wg.shutdown()


def test_release_kills_the_spares_outside_bundles_and_refill_starts_new_ones(ray_cluster):
    wg = make_group(1, "release", max_restarts=1, call_timeout_s=60)
    pool = SparePool(wg, 2, timeout_s=30)
    try:
        wait_until(lambda: len(pool.ready()) == 2, 60, 0.2, "the spares to start")
        old = [s.handle for s in pool._spares]
        kept = wg.workers[0]
        pool.give(kept)  # as a replaced rank's process is: it lives in the rank's bundle
        pool.release()
        assert [s.handle for s in pool._spares] == [kept] and ray.get(kept.ping.remote(), timeout=30)
        wait_until(lambda: all(dead_for_good(h) for h in old), 30, 0.2, "the released spares to be killed")
        pool.refill()  # one more: the kept one counts
        wait_until(lambda: len(pool.ready()) == 2, 60, 0.2, "the refilled spare to start")
        assert not {s.handle._actor_id for s in pool._spares} & {h._actor_id for h in old}
        pool.refill()  # full: starts nothing
        assert len(pool) == 2
    finally:
        pool.shutdown()
        wg.shutdown()


def test_a_pool_knows_when_a_bundle_waits_to_be_placed(ray_cluster):
    from ray.util.placement_group import placement_group

    placed = RayResourcePool([1], use_gpu=False, name_prefix="placed", cpus_per_bundle=0.1)
    waiting = RayResourcePool([1], use_gpu=False, name_prefix="waiting", cpus_per_bundle=0.1)
    try:
        placed.get_placement_groups()
        assert not placed.unplaced()
        # A bundle no node can hold now stays pending, as a lost node's bundles do until placed again.
        waiting.pgs = [placement_group([{"CPU": 0.1, "rrl_test_missing": 1.0}])]
        wait_until(lambda: waiting.unplaced(), 10, 0.2, "the pending bundle to be reported")
    finally:
        placed.release()
        waiting.release()


@pytest.mark.slow  # the default set's recovery through a spare: chaos/test_spare_faults.py
def test_colocated_run_recovers_through_a_spare_and_matches_the_fault_free_run(ray_cluster, tmp_path):
    fast = ("checkpoint.save_every=20", "recovery.snapshot_every=1", "recovery.spares=1", "trainer.total_steps=4")
    reference = PPOTrainer(small_cfg(tmp_path, "ref", *fast))
    try:
        reference.fit()
    finally:
        reference.shutdown()
    # Inside the update, so the death is seen at once: a death between calls is seen only by the
    # next call, by when Ray may have restarted the process itself (with no spare needed).
    schedule = FaultSchedule().after_snapshot(3).kill("actor", 1, in_call="update_actor")
    trainer = PPOTrainer(small_cfg(tmp_path, "faulted", *fast), hooks=[schedule])
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    events = trainer.run_dir.read_events()
    adopted = [e for e in events if e["event"] == "spare_adopted"]
    assert [(e["role"], e["rank"]) for e in adopted] == [("actor", 1)], adopted
    rec = [e for e in events if e["event"] == "recovered"]
    assert len(rec) == 1 and rec[0]["source"] == "snapshot" and rec[0]["steps_replayed"] == 0
    assert deterministic_view(trainer.run_dir.read_metrics()) == deterministic_view(reference.run_dir.read_metrics())


class _Pool:
    """A spare pool with ``ready`` spares (each adoption takes one)."""

    def __init__(self, ready: int):
        self.n, self.adopted = ready, []

    def ready(self):
        return [object()] * self.n

    def adopt(self, rank):
        if not self.n:
            return None
        self.n -= 1
        self.adopted.append(rank)
        return types.SimpleNamespace(pid=1000 + rank)


def _roles_with(spares: dict[str, int], unplaced: set[str]):
    from resilient_rl.runtime.pool.ray_roles import RayRoles

    roles = object.__new__(RayRoles)
    roles.spares = {name: _Pool(n) for name, n in spares.items()}
    groups = {name: types.SimpleNamespace(name_prefix=name, resource_pool=types.SimpleNamespace(
        unplaced=lambda name=name: name in unplaced)) for name in spares}
    roles.processes = groups
    roles.torch_groups, roles.groups, roles.worker_info = [], {}, {}
    return roles


def test_a_group_whose_bundles_wait_to_be_placed_takes_spares_only_for_every_dead_rank():
    # Bundles placed (a process died, its node lives): each spare takes a rank, the rest restart in place.
    roles = _roles_with({"actor": 1}, unplaced=set())
    assert roles.adopt_spares([("actor", 0), ("actor", 1)]) == [("actor", 0)]
    # Node lost with both ranks, one spare: none is taken (the placement group must be placed anyway).
    roles = _roles_with({"actor": 1, "critic": 1}, unplaced={"actor"})
    assert roles.adopt_spares([("actor", 0), ("actor", 1), ("critic", 0)]) == [("critic", 0)]
    assert roles.spares["actor"].adopted == []
    # Node lost, a spare for every dead rank: the group goes on without its placement group.
    roles = _roles_with({"actor": 2}, unplaced={"actor"})
    assert roles.adopt_spares([("actor", 0), ("actor", 1)]) == [("actor", 0), ("actor", 1)]
