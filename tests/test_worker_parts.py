"""A worker's parts (runtime/parts.py): a collaborator's registered methods are calls of the
worker, bound on its worker group and sent through the worker's one generic endpoint with the
Ray options the method declares; nothing else of a part can be called so."""

from __future__ import annotations

import sys
import threading
import time
from types import MappingProxyType

import pytest
import ray

from resilient_rl import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from resilient_rl.errors import DispatchError
from resilient_rl.runtime import parts
from resilient_rl.runtime.health import HEALTH_GROUPS
from resilient_rl.runtime.worker_class import create_colocated_worker_cls

# The worker processes cannot import this module: its classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Tally:
    """A part: a count of its own, and the rank it is told."""

    def __init__(self, place) -> None:
        self.place = place
        self.total = 0
        self.release = threading.Event()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, n: int) -> tuple[int, int]:
        self.total += n
        return self.place(), self.total

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def block(self) -> bool:
        """Runs on the call thread until released."""
        return self.release.wait(60)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group="snapshot", num_returns=2)
    def unblock(self) -> tuple[str, int]:
        """On a thread of its own: answers while ``block`` runs, and releases it."""
        self.release.set()
        return "released", self.total

    def internal(self) -> int:  # not registered: not a call of the worker
        return self.total


class Counting(Worker):
    parts = MappingProxyType({"tally": Tally})

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.tally = Tally(lambda: self.rank)
        self.tally.total = start

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def own(self) -> str:
        return "own"


def test_a_parts_registered_methods_are_the_workers_calls_and_nothing_else():
    assert set(parts.part_methods(Counting)) == {"add", "block", "unblock"}
    routes = parts.routes(Counting, "actor_")
    assert routes["actor_unblock"] == ("actor.tally.unblock", {"concurrency_group": "snapshot", "num_returns": 2})
    assert routes["actor_add"] == ("actor.tally.add", {})
    worker = Counting(start=5)
    assert worker.call_part("tally.add", 2)[1] == 7
    with pytest.raises(DispatchError, match="no registered method 'internal'"):
        worker.call_part("tally.internal")
    with pytest.raises(DispatchError, match="has no part 'engine'"):
        worker.call_part("engine.add", 1)
    worker.tally = object()
    with pytest.raises(DispatchError, match="not the declared Tally"):
        worker.call_part("tally.add", 1)


def test_a_part_method_may_not_shadow_another_call():
    class Clashing(Counting):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def add(self, n: int) -> int:
            return n

    with pytest.raises(DispatchError, match="the tally part's add clashes with Clashing's own"):
        parts.part_methods(Clashing)


@pytest.mark.ray
def test_a_group_calls_parts_with_their_threads_alone_and_colocated(ray_cluster):
    remote = ray.remote(concurrency_groups=HEALTH_GROUPS)(Counting)
    alone = RayWorkerGroup(RayResourcePool([2], use_gpu=False, name_prefix="parts", cpus_per_bundle=0.1),
                           RayClassWithInitArgs(remote, start=10))
    pool = RayResourcePool([2], use_gpu=False, name_prefix="partsco", cpus_per_bundle=0.1)
    colocated = RayWorkerGroup(pool, create_colocated_worker_cls({"actor": RayClassWithInitArgs(remote, start=1),
                                                                  "critic": RayClassWithInitArgs(remote, start=100)}))
    try:
        assert alone.add(1) == [(0, 11), (1, 11)] and alone.own() == ["own", "own"]
        roles = colocated.spawn(prefix_set=("actor", "critic"))
        assert roles["actor"].add(1) == [(0, 2), (1, 2)] and roles["critic"].add(1) == [(0, 101), (1, 101)]
        assert ray.get(roles["critic"].execute_rank_async(1, "add", 5)) == (1, 106)
        assert ray.get(colocated.execute_rank_async(0, "actor_add", 5)) == (0, 7)  # the fused group's name
        for group in (alone, roles["actor"]):
            blocked = group.execute_rank_async(0, "block")
            time.sleep(0.2)
            released, total = group.execute_rank_async(0, "unblock")  # two returns, on its own thread
            assert ray.get(released, timeout=30) == "released" and ray.get(blocked, timeout=30) is True
    finally:
        alone.shutdown()
        colocated.shutdown()
