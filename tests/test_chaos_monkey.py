"""The live chaos monkey against a real worker group on a local Ray cluster."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import ray

from resilient_rl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker
from resilient_rl.faults.injectors import FaultError, process_state
from resilient_rl.faults.monkey import ChaosMonkey, find_run_workers

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.ray


@ray.remote
class Idle(Worker):
    pass


def test_monkey_finds_and_hits_the_runs_workers(ray_cluster):
    pool = RayResourcePool([2], name_prefix="rrl_monkeyrun_ab12_actor", cpus_per_bundle=0.05)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Idle), max_restarts=2)
    try:
        before = {i.pid for i in wg.ping()}
        targets = find_run_workers("monkeyrun")
        assert [(t.group, t.rank) for t in targets] == [("actor", 0), ("actor", 1)]
        assert {t.pid for t in targets} == before

        lines = []
        dry = ChaosMonkey("monkeyrun", interval_s=0, max_faults=3, seed=1, dry_run=True, echo=lines.append)
        dry.run()
        assert len(dry.done) == 3 and all("would send" in line for line in lines[1:])
        assert all(process_state(p) not in (None, "Z", "T") for p in before), "a dry run touches nothing"

        monkey = ChaosMonkey("monkeyrun", interval_s=0, max_faults=1, kinds=("sigstop",), seed=3, echo=lines.append)
        (kind, target), = monkey.run()
        deadline = time.monotonic() + 10
        while process_state(target.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_state(target.pid) == "T", "the chosen worker is stopped"

        monkey = ChaosMonkey("monkeyrun", interval_s=0, max_faults=1, kinds=("sigkill",), seed=3, echo=lines.append)
        (kind, target), = monkey.run()
        assert wg.wait_alive(60)  # Ray restarts it
        assert target.pid not in {i.pid for i in wg.ping()}
    finally:
        wg.shutdown()
    with pytest.raises(FaultError, match="no live workers of run 'nothing'"):
        ChaosMonkey("nothing", interval_s=0, max_faults=1, echo=lambda s: None).run()
    with pytest.raises(FaultError, match="unknown fault kind"):
        ChaosMonkey("x", 1, 1, kinds=("explode",))
