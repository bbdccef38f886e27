"""Integration tests of the single-controller runtime on a local CPU Ray cluster."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import cloudpickle
import numpy as np
import pytest
import ray
import torch

from resilient_rl import (DataProto, Dispatch, Execute, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup,
                          Worker, create_colocated_worker_cls, merge_resource_pool, register)
from resilient_rl.runtime.ended_calls import read_ended
from resilient_rl.runtime.group_call import results_in_order, results_together
from resilient_rl.errors import CollectiveError, DispatchError, ResourceError, WorkerDiedError, WorkerError
from resilient_rl.testing.wait import wait_until

# Workers defined here travel to the actors by value (the test module is not importable there).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.ray


@ray.remote
class EchoWorker(Worker):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self, tag):
        return {"rank": self.rank, "world_size": self.world_size, "tag": tag, "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, x):
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def add_rank(self, x):
        return x + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict({"y": data.batch["x"] * 2 * self.scale,
                                   "rank": torch.full((len(data),), self.rank)},
                                  {"uid": data.non_tensor_batch["uid"]})
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": fn(data.batch["x"])})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto):
        return {"rank": self.rank, "sum": float(data.batch["x"].sum())}

    @register(dispatch_mode={"dispatch_fn": lambda wg, x: (([x * (i + 1) for i in range(wg.world_size)],), {}),
                             "collect_fn": lambda wg, out: sum(out)})
    def custom(self, x):
        return x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self):
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, x):
        return x * 10

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_after(self, delays):
        time.sleep(delays[self.rank])
        raise RuntimeError(f"rank {self.rank} failed")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit_now(self):
        os._exit(1)


@ray.remote
class CriticLike(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def role(self):
        return ("critic", self.rank, os.getpid())


@ray.remote
class SlowToWarm(Worker):
    """A worker whose warm-up imports (:meth:`~resilient_rl.runtime.worker.RankWorker.warm_imports`)
    take a while: the process answers at once and is warmed up only after them."""

    def warm_imports(self):
        time.sleep(0.5)
        self.warm = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def is_warm(self):
        return getattr(self, "warm", False)


def proto(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)},
                               {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)})


def make_group(n: int, prefix: str, **kw) -> RayWorkerGroup:
    pool = RayResourcePool([n], use_gpu=False, name_prefix=prefix, cpus_per_bundle=0.1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, scale=1.0), **kw)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_dispatch_mode(ray_cluster, n):
    wg = make_group(n, f"modes{n}")
    try:
        assert wg.world_size == n and len(wg.workers) == n
        info = wg.describe("t")
        assert [i["rank"] for i in info] == list(range(n)) and {i["world_size"] for i in info} == {n}
        assert len({i["pid"] for i in info}) == n
        assert wg.echo([f"a{i}" for i in range(n)]) == [(i, f"a{i}") for i in range(n)]
        assert wg.add_rank([10] * n) == [10 + i for i in range(n)]
        # 7 rows is uneven for n in (2, 3, 4): padded on dispatch, unpadded on collect
        out = wg.double(proto(7))
        assert len(out) == 7
        assert out.batch["y"].tolist() == [2.0 * i for i in range(7)]
        assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(7)]
        ranks = out.batch["rank"].tolist()
        assert ranks == sorted(ranks) and set(ranks) == set(range(n))
        applied = wg.apply(torch.neg, proto(8))
        assert applied.batch["y"].tolist() == [-float(i) for i in range(8)]
        metrics = wg.metric(proto(4 * n))
        assert [m["rank"] for m in metrics] == list(range(n))
        assert sum(m["sum"] for m in metrics) == float(sum(range(4 * n)))
        assert wg.custom(2) == sum(2 * (i + 1) for i in range(n))
        assert wg.only_rank_zero() == 0
        refs = wg.later(4)
        assert ray.get(refs) == [40] * n
        assert wg.execute_all_sync("echo", "same") == [(i, "same") for i in range(n)]
        assert wg.execute_rank_zero_sync("echo", 5) == (0, 5)
        # submit: several calls in flight at once, each collected as its blocking call returns it.
        calls = [wg.submit("double", proto(7)), wg.submit("metric", proto(4 * n)), wg.submit("only_rank_zero"),
                 wg.submit("custom", 2), wg.submit("later", 4)]
        doubled, metrics_again, zero, custom, later = (c.result() for c in calls)
        assert doubled.batch["y"].tolist() == out.batch["y"].tolist() and len(doubled) == 7
        assert metrics_again == metrics and zero == 0 and custom == wg.custom(2)
        assert later == [40] * n  # a non-blocking method's call, collected, gives the values
    finally:
        wg.shutdown()


def test_bad_input_fails_fast(ray_cluster):
    wg = make_group(2, "bad")
    try:
        with pytest.raises(DispatchError, match="no method 'nope'"):
            wg.execute_all_sync("nope")
        with pytest.raises(DispatchError, match="no registered method 'nope'"):
            wg.submit("nope")
        with pytest.raises(DispatchError, match="world size 2.*length 3"):
            wg.add_rank([1, 2, 3])
        data = proto(3)
        data.meta_info["auto_padding"] = False
        with pytest.raises(DispatchError, match="length 3 cannot be split into 2"):
            wg.double(data)
    finally:
        wg.shutdown()
    # Refused by the feasibility check before any placement group is asked for (a wait for
    # placement would end in "were not placed within", after placement_timeout_s).
    gpu = RayResourcePool([2], use_gpu=True, name_prefix="gpu")
    fat = RayResourcePool([4], use_gpu=False, cpus_per_bundle=10, name_prefix="fat")
    with pytest.raises(ResourceError, match="asks for 2 GPU"):
        gpu.get_placement_groups()
    with pytest.raises(ResourceError, match="asks for 40 CPU"):
        fat.get_placement_groups()
    assert gpu.pgs is None and fat.pgs is None
    names = {pg["name"] for pg in ray.util.placement_group_table().values()}
    assert not any(n.startswith(("gpu_pg", "fat_pg")) for n in names), names


def test_colocated_roles_share_one_process_per_bundle(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="coloc", cpus_per_bundle=0.1)
    cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(EchoWorker, scale=3.0),
                                       "critic": RayClassWithInitArgs(CriticLike)})
    wg = RayWorkerGroup(pool, cls)
    try:
        groups = wg.spawn(prefix_set={"actor", "critic"})
        actor, critic = groups["actor"], groups["critic"]
        a = actor.describe("x")
        c = critic.role()
        assert [x["pid"] for x in a] == [x[2] for x in c]  # same processes
        assert [x[:2] for x in c] == [("critic", 0), ("critic", 1)]
        out = actor.double(proto(4))
        assert out.batch["y"].tolist() == [0.0, 6.0, 12.0, 18.0]  # scale=3 reached the actor role
        # Calls to two roles of one process, in flight together, run there in order.
        calls = [actor.submit("double", proto(4)), critic.submit("role")]
        assert calls[0].result().batch["y"].tolist() == [0.0, 6.0, 12.0, 18.0] and calls[1].result() == c
        with pytest.raises(DispatchError, match="no colocated role 'ref'"):
            wg.spawn(prefix_set={"ref"})
    finally:
        wg.shutdown()


def test_a_worker_is_warmed_up_only_once_its_own_warm_up_imports_are_done(ray_cluster):
    single = RayWorkerGroup(RayResourcePool([1], use_gpu=False, name_prefix="warm1", cpus_per_bundle=0.1),
                            RayClassWithInitArgs(SlowToWarm))
    colocated = RayWorkerGroup(RayResourcePool([1], use_gpu=False, name_prefix="warm2", cpus_per_bundle=0.1),
                               create_colocated_worker_cls({"a": RayClassWithInitArgs(SlowToWarm),
                                                            "b": RayClassWithInitArgs(SlowToWarm)}))
    try:
        ray.get([w.warmed_up.remote() for w in single.workers + colocated.workers])
        roles = colocated.spawn(prefix_set={"a", "b"})
        assert single.is_warm() == [True] and roles["a"].is_warm() == [True] and roles["b"].is_warm() == [True]
    finally:
        single.shutdown()
        colocated.shutdown()


def test_merged_pools_and_all_reduce_after_rendezvous(ray_cluster):
    pool = merge_resource_pool(RayResourcePool([1], use_gpu=False, name_prefix="m1"),
                               RayResourcePool([2], use_gpu=False, name_prefix="m2"))
    assert pool.store == [1, 2] and pool.world_size == 3
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker))
    try:
        assert [i["rank"] for i in wg.describe(0)] == [0, 1, 2]
        wg.init_process_group(generation=1, backend="gloo", timeout_s=30)
        # sum over ranks of 2 * (rank + 1) = 2 * (1 + 2 + 3)
        assert wg.all_reduce_check(2.0) == [12.0] * 3
        assert {i.generation for i in wg.ping()} == {1}
    finally:
        wg.shutdown()
    with pytest.raises(ResourceError, match="already exist"):
        p = RayResourcePool([1], use_gpu=False, name_prefix="m3")
        p.get_placement_groups()
        try:
            merge_resource_pool(p, RayResourcePool([1], use_gpu=False, name_prefix="m4"))
        finally:
            p.release()


def test_second_rendezvous_after_sigkill_and_ray_restart(ray_cluster):
    wg = make_group(2, "restart", max_restarts=2, call_timeout_s=60)
    try:
        wg.init_process_group(generation=1, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
        victim_pid = wg.ping()[1].pid
        os.kill(victim_pid, signal.SIGKILL)
        # the dead rank's call reports its death, or the survivor's collective fails first
        with pytest.raises((WorkerDiedError, CollectiveError)) as err:
            wg.all_reduce_check(1.0)
        assert (type(err.value), err.value.rank) in ((WorkerDiedError, 1), (CollectiveError, 0)), err.value
        # Ray restarts the actor (max_restarts); until then a ping fails or times out
        infos = wait_until(lambda: wg.ping(timeout_s=10), 60, 0.5, "the killed rank to be restarted",
                           ignore=(WorkerError,))
        assert infos[1].pid != victim_pid and infos[0].generation == 1 and infos[1].generation is None
        wg.init_process_group(generation=2, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
        assert [i.generation for i in wg.ping()] == [2, 2]
    finally:
        wg.shutdown()


def test_calls_waited_together_end_at_the_first_failure_of_any(ray_cluster):
    """The weight sync's two calls wait on each other (actor rank 0 broadcasts to the rollout
    ranks). When a rollout rank dies, actor rank 0 stays blocked in the broadcast (NCCL within a
    node never learns of the death): waited for together, the death ends the wait at once, where
    waited for in order it would be heard of only once the blocked call ended."""
    blocked, dying = make_group(1, "together_blocked"), make_group(2, "together_dying")
    try:
        assert results_together([blocked.submit("describe", "a"), dying.submit("echo", ["b", "c"])]) == [
            [{"rank": 0, "world_size": 1, "tag": "a", "pid": blocked.describe("pid")[0]["pid"]}],
            [(0, "b"), (1, "c")]]
        with pytest.raises(WorkerDiedError, match="together_dying"):
            results_together([blocked.submit("fail_after", [120.0]), dying.submit("exit_now")])
        assert blocked.abandoned.read() == 1, "the blocked call runs on, abandoned to its group"
    finally:
        blocked.shutdown()
        dying.shutdown()


def test_calls_left_by_a_failed_wait_are_read(ray_cluster, monkeypatch):
    """A wait fails fast on rank 0's error while rank 1's call runs on and fails later, and so does
    a call on another group collected after it. Nobody waits for those; Ray would log their errors
    as "Unhandled error" once their refs are freed unread, on the user's console, long after the
    failure was handled. Their groups read them."""
    unhandled = []
    monkeypatch.setattr(ray._private.worker, "_unhandled_error_handler", unhandled.append)
    wg, other = make_group(2, "unread"), make_group(1, "unread_other")
    try:
        with pytest.raises(WorkerError, match="rank 0 failed"):
            wg.fail_after([0.0, 1.0])
        with pytest.raises(WorkerError, match="rank 0 failed"):
            list(results_in_order([wg.submit("fail_after", [0.0, 0.5]), other.submit("fail_after", [1.0])]))
        # Queued behind the failing calls: when these return, those have ended.
        assert wg.describe("after")[1]["rank"] == 1 and other.describe("after")[0]["rank"] == 0
        wait_until(lambda: wg.abandoned.read() == other.abandoned.read() == 0, 30, 0.1, "the calls to be read")
        gc.collect()
        time.sleep(0.5)  # the handler runs on Ray's own thread
        assert unhandled == []
    finally:
        wg.shutdown()
        other.shutdown()


@ray.remote(num_cpus=0)
def _after(value, delay_s: float = 0.0):
    time.sleep(delay_s)
    if isinstance(value, Exception):
        raise value
    return value


def test_read_ended_takes_what_ended_and_leaves_what_runs(ray_cluster):
    """The controller's never-waiting read of its calls in flight: a call that returned gives its
    value, one that failed its error, one still running is left for a later read."""
    returned, failed, running = _after.remote(1), _after.remote(ValueError("boom")), _after.remote(2, 3.0)
    short = [returned, failed]
    wait_until(lambda: len(ray.wait(short, num_returns=2, timeout=0)[0]) == 2, 30, 0.05, "the short calls to end")
    ended, still = read_ended([returned, failed, running])
    assert still == [running]
    by_ref = {ref: (value, error) for ref, value, error in ended}
    assert set(by_ref) == {returned, failed}
    assert by_ref[returned] == (1, None)
    assert by_ref[failed][0] is None and "boom" in str(by_ref[failed][1])
    assert read_ended([]) == ([], [])
    assert ray.get(running) == 2
