"""verl's worker, dispatch and pool contracts that need no Ray cluster."""

from __future__ import annotations

import pytest
import torch

from resilient_rl import (DataProto, Dispatch, RayResourcePool, RayWorkerGroup, Worker, get_predefined_dispatch_fn,
                          register, register_dispatch_mode, split_resource_pool, update_dispatch_mode)
from resilient_rl.runtime.dispatch import collect_all_to_all, dispatch_one_to_all, registered_methods
from resilient_rl.runtime.dispatch_nd import dispatch_lazy_compute_data_proto, collect_lazy_compute_data_proto
from resilient_rl.errors import DispatchError, ResourceError
from resilient_rl.runtime.worker_group_verl import checked_worker_env


class NoSuperInit(Worker):
    def __init__(self, x):  # verl users may skip super().__init__()
        self.x = x


def test_worker_without_super_init_has_its_identity(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    w = NoSuperInit(5)
    assert (w.rank, w.world_size, w.identity.local_rank) == (3, 4, 1)
    assert w.ping().rank == 3
    assert "MASTER_PORT" in Worker.env_keys()


def test_dispatch_collect_registration_as_verl(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    ref, actor, fused = Worker(), Worker(), Worker()
    ref._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)
    fused.set_dispatch_collect(mesh_name="ref", **ref.get_dispatch_collect())
    fused.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    assert fused._query_dispatch_info("ref") == 0 and fused._query_collect_info("ref")
    assert fused._query_dispatch_info("actor") == 1 and not fused._query_collect_info("actor")
    with pytest.raises(AssertionError):
        fused.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    with pytest.raises(ValueError, match="has been registered"):
        ref._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)


def test_async_register_keeps_a_coroutine_and_verl_helpers_are_registered():
    import inspect

    class W(Worker):
        @register(Dispatch.ONE_TO_ALL)
        async def go(self, x):
            return x

    assert inspect.iscoroutinefunction(W.go)
    names = registered_methods(W)
    assert {"go", "execute_with_func_generator", "execute_func_rank_zero", "_query_dispatch_info"} <= set(names)


def test_register_and_update_dispatch_mode():
    def dispatch(wg, *a, **k):
        return a, k

    mode = register_dispatch_mode("RRL_TEST_MODE", dispatch, collect_all_to_all)
    assert Dispatch.RRL_TEST_MODE is mode
    assert get_predefined_dispatch_fn(mode)["dispatch_fn"] is dispatch
    register(dispatch_mode=Dispatch.RRL_TEST_MODE)(lambda self: None)  # usable in @register
    with pytest.raises(DispatchError, match="already exists"):
        register_dispatch_mode("RRL_TEST_MODE", dispatch, collect_all_to_all)
    update_dispatch_mode(mode, dispatch_one_to_all, collect_all_to_all)
    assert get_predefined_dispatch_fn(mode)["dispatch_fn"] is dispatch_one_to_all
    with pytest.raises(DispatchError, match="not found"):
        update_dispatch_mode("nope", dispatch, collect_all_to_all)


class _FakeGroup:
    """Just what nd dispatch reads from a group: its size and its ranks' mesh answers."""

    name_prefix = "fake"
    world_size = 4

    def __init__(self):
        self.queries = 0

    def _query_dispatch_info(self, mesh):
        self.queries += 1
        return [0, 0, 1, 1]  # two tensor-parallel ranks per data-parallel rank

    def _query_collect_info(self, mesh):
        return [True, False, True, False]


def test_nd_dispatch_splits_by_dp_rank_and_collects_masked_ranks():
    group = _FakeGroup()
    data = DataProto.from_dict({"x": torch.arange(4)})
    args, _ = dispatch_lazy_compute_data_proto("train", group, data)
    assert [a.batch["x"].tolist() for a in args[0]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    dispatch_lazy_compute_data_proto("train", group, data)
    assert group.queries == 1  # the mapping is asked once per group and mesh
    out = collect_lazy_compute_data_proto("train", group, list(args[0]))
    assert out.batch["x"].tolist() == [0, 1, 2, 3]


def test_group_options_unknown_rejected_and_worker_env_checked():
    with pytest.raises(TypeError, match="unknown keyword"):
        RayWorkerGroup(None, None, not_an_option=1)
    with pytest.raises(DispatchError, match="profile_steps"):
        RayWorkerGroup(None, None, profile_steps=[1])
    RayWorkerGroup(None, None, device_name="cuda", bin_pack=True)  # neutral verl options
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        checked_worker_env({"WORLD_SIZE": "100"})


def test_pool_defaults_and_split_checks():
    pool = RayResourcePool([4])
    assert pool.use_gpu is True and pool.max_colocate_count == 10  # verl's defaults
    assert pool.next_group_prefix() == pool.name_prefix
    assert pool.next_group_prefix() != pool.name_prefix  # a second group's actors get other names
    with pytest.raises(ResourceError, match="divisor"):
        split_resource_pool(RayResourcePool([4], use_gpu=False), 3)
    with pytest.raises(ResourceError, match="summing"):
        split_resource_pool(RayResourcePool([4], use_gpu=False), [1, 2])
