"""verl's worker-group contracts on a local CPU Ray cluster (one per module): the env://
contract, user methods, async and non-blocking calls, pools shared and split, detached and
fused groups, nd dispatch."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
import torch.distributed as dist

from resilient_rl import (DataProto, DataProtoFuture, Dispatch, RayClassWithInitArgs, RayResourcePool,
                          RayWorkerGroup, Worker, create_colocated_worker_cls_fused, create_colocated_worker_raw_cls,
                          make_nd_compute_dataproto_dispatch_fn, register, split_resource_pool)
from resilient_rl.errors import WorkerError
from resilient_rl.testing.wait import wait_until
from resilient_rl.runtime import health

pytestmark = pytest.mark.ray

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE",
       "MASTER_ADDR", "MASTER_PORT", "custom")


@ray.remote
class EnvWorker(Worker):
    """A verl-style worker: no super().__init__(), its own env:// process group in __init__."""

    def __init__(self, scale):
        self.scale = scale
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")

    @register(Dispatch.ONE_TO_ALL)
    def env(self):
        return {k: os.environ.get(k) for k in ENV}

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value):
        t = torch.tensor([float(value * (self.rank + 1))])
        dist.all_reduce(t)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def get(self, key):  # a name the group itself uses for a helper
        return (self.rank, key)

    @register(Dispatch.DP_COMPUTE_PROTO)
    async def double(self, data: DataProto):
        await asyncio.sleep(0)
        data.batch["x"] = data.batch["x"] * 2 * self.scale
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def plus_rank(self, data: DataProto):
        data.batch["x"] = data.batch["x"] + self.rank
        return data


@pytest.fixture(scope="module")
def env_group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker, scale=1), worker_env={"custom": "v"})
    yield wg
    wg.shutdown()


def test_env_contract_before_init_and_user_process_group(env_group):
    envs = env_group.env()
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["RAY_LOCAL_RANK"] for e in envs] == ["0", "1"] and {e["RAY_LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1 and envs[0]["MASTER_PORT"]
    assert {e["custom"] for e in envs} == {"v"}
    assert env_group.all_reduce(1.0) == [3.0, 3.0]  # the group the workers made through env:// works


def test_user_method_named_get_async_and_non_blocking_calls(env_group):
    assert env_group.get("k") == [(0, "k"), (1, "k")]
    data = DataProto.from_dict({"x": torch.arange(4.0)})
    assert env_group.double(data).batch["x"].tolist() == [0.0, 2.0, 4.0, 6.0]
    future = env_group.plus_rank(DataProto.from_dict({"x": torch.zeros(3)}))  # padded to 4, unpadded on get
    assert isinstance(future, DataProtoFuture)
    assert future.get().batch["x"].tolist() == [0.0, 0.0, 1.0]
    # A future goes straight to the next call: each rank fetches and keeps its chunk.
    chained = env_group.double(env_group.plus_rank(DataProto.from_dict({"x": torch.zeros(4)})))
    assert chained.batch["x"].tolist() == [0.0, 0.0, 2.0, 2.0]


def test_execute_with_func_generator_and_rank_zero(env_group):
    def func(worker, data):
        data.batch["x"] = data.batch["x"] + 10 * worker.rank
        return data

    out = env_group.execute_with_func_generator(func, DataProto.from_dict({"x": torch.zeros(2)}))
    assert out.batch["x"].tolist() == [0.0, 10.0]
    assert env_group.execute_func_rank_zero(lambda a, b: a + b, 1, 2) == 3


@ray.remote
class LaterGroupWorker(Worker):
    """Reads the env:// contract; its process group is the controller's (rendezvous)."""

    @register(Dispatch.ONE_TO_ALL)
    def env(self):
        return {k: os.environ.get(k) for k in ENV}


def _restarted(wg, old_pid):
    try:
        return health.wait_alive(wg, 30.0)[0].pid != old_pid
    except WorkerError:
        return False


def test_restarted_rank_zero_publishes_a_new_master_and_rendezvous_refreshes_it(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(LaterGroupWorker), max_restarts=1)
    try:
        before, old_pid = wg.env(), wg.ping()[0].pid
        ray.kill(wg.workers[0], no_restart=False)
        # Killing is asynchronous: wait for rank 0's new process, not the dying one's last answer.
        wait_until(lambda: _restarted(wg, old_pid), 120, 0.5, "rank 0 to be restarted")
        after = wg.env()
        assert after[0]["RANK"] == "0" and after[0]["MASTER_PORT"]  # restarted with its identity
        wg.init_process_group(generation=1, backend="gloo", timeout_s=30.0)  # the controller's rendezvous
        refreshed = wg.env()
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in refreshed}) == 1
        assert refreshed[1]["MASTER_PORT"] != before[1]["MASTER_PORT"]
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
    finally:
        wg.shutdown()


@ray.remote
class Plain(Worker):
    def __init__(self, tag=0):
        super().__init__()
        self.tag = tag
        self._register_dispatch_collect_info("train", dp_rank=self.rank, is_collect=self.rank == 0)

    @register(Dispatch.ONE_TO_ALL)
    def who(self):
        return (self.tag, self.rank)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto):
        data.batch["x"] = data.batch["x"] + self.tag + self.rank
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def nd(self, data: DataProto):
        data.batch["x"] = data.batch["x"] + 100 * self.rank
        return data


def test_two_groups_on_one_pool_and_nd_dispatch(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)  # verl's max_colocate_count: both groups fit
    a = RayWorkerGroup(pool, RayClassWithInitArgs(Plain, tag=1))
    b = RayWorkerGroup(pool, RayClassWithInitArgs(Plain, tag=2))
    try:
        assert set(a.worker_names).isdisjoint(b.worker_names)
        assert a.who() == [(1, 0), (1, 1)] and b.who() == [(2, 0), (2, 1)]
        # dp rank = rank, only rank 0 collected: the second chunk's output is dropped.
        out = a.nd(DataProto.from_dict({"x": torch.zeros(4)}))
        assert out.batch["x"].tolist() == [0.0, 0.0]
    finally:
        b.shutdown(release_pool=False)
        a.shutdown()


def test_split_pool_and_from_detached(ray_cluster):
    whole = RayResourcePool([2], use_gpu=False)
    first, second = split_resource_pool(whole, 1)
    g1 = RayWorkerGroup(first, RayClassWithInitArgs(Plain, tag=0))
    g2 = RayWorkerGroup(second, RayClassWithInitArgs(Plain, tag=100))
    try:
        assert g1.world_size == g2.world_size == 1
        data = DataProto.from_dict({"x": torch.zeros(2)})
        assert g2.add(data).batch["x"].tolist() == [100.0, 100.0]
        attached = RayWorkerGroup.from_detached(worker_names=g2.worker_names,
                                                ray_cls_with_init=RayClassWithInitArgs(Plain))
        assert attached.who() == [(100, 0)]
    finally:
        g1.shutdown(release_pool=False)
        g2.shutdown(release_pool=False)
        whole.release()


@ray.remote
class Actor(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank


@ray.remote
class Critic(Worker):
    def __init__(self, val):
        super().__init__()
        self.val = val

    @register(Dispatch.ALL_TO_ALL)
    def sub(self, x):
        return x - self.val


CLASSES = {"actor": RayClassWithInitArgs(cls=Actor), "critic": RayClassWithInitArgs(cls=Critic, val=10)}


@ray.remote
class Hybrid(create_colocated_worker_raw_cls(CLASSES)):
    @register(Dispatch.ONE_TO_ALL)
    def foo(self, x):
        return self.critic.sub(self.actor.add(x))


def test_fused_raw_class_with_fuse_and_fused_spawn(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    fused = RayWorkerGroup(pool, RayClassWithInitArgs(cls=Hybrid))
    spawned_root = RayWorkerGroup(pool, create_colocated_worker_cls_fused(CLASSES))
    try:
        fused.fuse(CLASSES.keys())
        y = fused.critic.sub(fused.actor.add(0.5))
        assert y == fused.foo(0.5) == [-9.5, -8.5]
        roles = spawned_root.spawn(prefix_set=CLASSES.keys())
        assert roles["actor"].add(1) == [1, 2] and roles["critic"].sub([1, 2]) == [-9, -8]
    finally:
        spawned_root.shutdown(release_pool=False)
        fused.shutdown()
