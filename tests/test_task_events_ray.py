"""Ray task events of the worker groups: the GCS keeps none for the controller's calls to its ranks
(a record of every call, per step, that nothing reads), unless the worker class or the group's
``actor_options`` ask for them."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import ray

from resilient_rl import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from resilient_rl.config.schema import load_config
from resilient_rl.runtime.worker_class import task_event_options
from resilient_rl.testing import task_events
from resilient_rl.trainer.ppo import PPOTrainer

# Workers defined here travel to the actors by value (the test module is not importable there).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.ray

N = 2


@ray.remote
class Echo(Worker):
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, x):
        return x


@ray.remote(enable_task_events=True)
class EchoRecorded(Echo.__ray_actor_class__):  # type: ignore[name-defined]
    pass


def group(cls, prefix: str, **kw) -> RayWorkerGroup:
    pool = RayResourcePool([N], use_gpu=False, name_prefix=prefix, cpus_per_bundle=0.1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(cls), **kw)


def test_the_option_a_group_adds():
    assert task_event_options(Echo) == {"enable_task_events": False}
    assert task_event_options(EchoRecorded) == {}, "the class's own choice carries over"


def test_group_calls_leave_no_task_events_unless_asked(ray_cluster):
    # Two calls on a default group, three on each group that asks for the events.
    groups = [group(Echo, "quiet"), group(EchoRecorded, "asks"),
              group(Echo, "asked", actor_options={"enable_task_events": True})]
    try:
        for wg, calls in zip(groups, (2, 3, 3)):
            for i in range(calls):
                assert wg.echo([i] * N) == [i] * N
            wg.ping()
        held = task_events.settled()
    finally:
        for wg in groups:
            wg.shutdown()
    assert held.count("Ranked(Echo).echo") == 3 * N, "the default group's calls left events"
    assert held.count("Ranked(EchoRecorded).echo") == 3 * N


def test_training_steps_leave_no_task_events_of_the_worker_groups(ray_cluster, tmp_path):
    """Every call a step makes on the groups' actors (the dispatched methods, health polls, a
    spare's pings, weight sync), and the actors' creation, leave nothing in the GCS's task events."""
    cfg = load_config(None, ["trainer.total_steps=2", "trainer.progress_bar=false", "data.batch_size=16",
                             "actor.mini_batch_size=8", "critic.mini_batch_size=8", "data.num_prompts=64",
                             "ray.cpus_per_worker=0.05", f"trainer.output_dir={tmp_path}",
                             f"checkpoint.root={tmp_path}/ckpt", "trainer.run_name=events"])
    before = task_events.settled()  # the module's other tests' events
    trainer = PPOTrainer(cfg)
    try:
        rows = trainer.fit()
        added = task_events.settled().minus(before)
    finally:
        trainer.shutdown()
    assert [r["step"] for r in rows] == [1, 2]
    recorded = {name: n for name, n in added.by_name.items() if "Ranked(" in name}
    assert recorded == {}, f"the worker groups' actors recorded task events: {recorded}"
