"""The live chaos monkey against a real worker group on a local Ray cluster."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import ray

from resilient_rl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker
from resilient_rl.faults.injectors import FaultError
from resilient_rl.process_state import process_state
from resilient_rl.faults.monkey import ChaosMonkey, find_run_workers
from resilient_rl.testing.wait import wait_until
from resilient_rl.runtime import health

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.ray


@ray.remote
class Idle(Worker):
    pass


def test_monkey_finds_and_hits_the_runs_workers(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="rrl_monkeyrun_ab12_actor", cpus_per_bundle=0.05)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Idle), max_restarts=2)
    try:
        before = {i.pid for i in wg.ping()}
        targets = find_run_workers("monkeyrun")
        assert [(t.group, t.rank) for t in targets] == [("actor", 0), ("actor", 1)]
        assert {t.pid for t in targets} == before

        lines = []
        dry = ChaosMonkey("monkeyrun", interval_s=0, max_faults=3, seed=1, dry_run=True, echo=lines.append)
        dry.run()
        assert "actor rank 0" in lines[1] and "actor rank 1" in lines[1]
        assert len(dry.done) == 3 and all("would send" in line for line in lines[2:])
        assert all(process_state(p) not in (None, "zombie", "stopped") for p in before), "a dry run touches nothing"

        monkey = ChaosMonkey("monkeyrun", interval_s=0, max_faults=1, kinds=("sigstop",), seed=3, echo=lines.append)
        (kind, target), = monkey.run()
        wait_until(lambda: process_state(target.pid) == "stopped", 10, 0.1, "the chosen worker to be stopped")

        monkey = ChaosMonkey("monkeyrun", interval_s=0, max_faults=1, kinds=("sigkill",), seed=3, echo=lines.append)
        (kind, target), = monkey.run()
        assert health.wait_alive(wg, 60)  # Ray restarts it
        assert target.pid not in {i.pid for i in wg.ping()}
    finally:
        wg.shutdown()
    with pytest.raises(FaultError, match="no live workers of run 'nothing'"):
        ChaosMonkey("nothing", interval_s=0, max_faults=1, echo=lambda s: None).run()
    with pytest.raises(FaultError, match="unknown fault kind"):
        ChaosMonkey("x", 1, 1, kinds=("explode",))


def test_worker_names_parse_from_the_right():
    from resilient_rl.faults.monkey import parse_worker_name

    assert parse_worker_name("rrl_ppo_ab12cd_actor_1") == ("ppo", "ab12cd", "actor", 1)
    assert parse_worker_name("rrl_ppo_v2_ab12cd_main_0") == ("ppo_v2", "ab12cd", "main", 0)
    assert parse_worker_name("rrl_my_run.1_0f0f0f_critic_12") == ("my_run.1", "0f0f0f", "critic", 12)
    for bad in ("rrl_ppo_actor_0", "rrl_ppo_ab12cd_actor_x", "other_ppo_ab12cd_actor_0", "rrl__ab12cd_actor_0",
                "rrl_ppo_zz12cd_actor_0"):
        assert parse_worker_name(bad) is None, bad


def test_monkey_hits_only_the_named_run_not_one_sharing_its_prefix(ray_cluster):
    groups = [RayWorkerGroup(RayResourcePool([1], use_gpu=False, name_prefix=f"rrl_{run}_ab12cd_actor",
                                             cpus_per_bundle=0.05),
                             RayClassWithInitArgs(Idle)) for run in ("ppo", "ppo_v2")]
    try:
        (ppo,), (v2,) = ([i.pid for i in g.ping()] for g in groups)
        assert [(t.name, t.pid) for t in find_run_workers("ppo")] == [("rrl_ppo_ab12cd_actor_0", ppo)]
        assert [t.pid for t in find_run_workers("ppo_v2")] == [v2]
        hit = ChaosMonkey("ppo", interval_s=0, max_faults=5, seed=0, dry_run=True, echo=lambda s: None).run()
        assert {target.pid for _, target in hit} == {ppo}
    finally:
        for g in groups:
            g.shutdown()
