"""Warm spares of GPU groups: they reserve no GPU and take a dead rank's GPUs.

The device hand-over (:mod:`resilient_rl.runtime.devices`) is tested directly, and the spare
pool on a local Ray cluster with logical GPUs: Ray assigns them (``CUDA_VISIBLE_DEVICES``) to the
ranks exactly as on GPU machines, though no CUDA runs here. That a process given a GPU this way
computes on it is CUDA's part and needs a GPU machine.
"""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch

from resilient_rl.config.schema import load_config
from resilient_rl.runtime import devices
from resilient_rl.runtime.devices import NOSET_VISIBLE_DEVICES, DevicesUnavailable, see_ray_gpus_only, take_devices
from resilient_rl.runtime.resource_pool import RayResourcePool
from resilient_rl.runtime.spares import SparePool
from resilient_rl.runtime import worker
from resilient_rl.runtime.worker import cuda_device_index
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML
from resilient_rl.runtime.worker_group import RayClassWithInitArgs, RayWorkerGroup
from resilient_rl.errors import ConfigError
from resilient_rl.testing.wait import wait_until
from resilient_rl.workers.fsdp import uses_cuda
from resilient_rl.workers.roles import ActorWorker
from resilient_rl.runtime import health
from resilient_rl.runtime.worker_group_spares import OVERRIDE_ON_ZERO, reidentify
from test_controller_ray import EchoWorker


# ---------------------------------------------------------------------------- the hand-over itself

def test_take_devices_sets_the_rank_s_devices_before_cuda_starts(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # restored after the test
    take_devices(None, "n1", "n1", driver_initialized=lambda: True)  # a CPU rank: nothing to take
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    take_devices("3", "n1", "n1", driver_initialized=lambda: False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and devices.visible_devices() == "3"
    # Already the rank's: nothing to do, whatever CUDA's state.
    take_devices("3", "n1", "n1", driver_initialized=lambda: True)


def test_a_rank_sees_only_its_ray_gpus_where_the_cluster_leaves_the_variable_alone(monkeypatch, caplog):
    """A cluster started with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: Ray gives the process
    GPU 2 but leaves every GPU of the node visible. The rank narrows the variable to its GPU first
    thing, before CUDA can read it; a process given no GPU (a spare) keeps seeing them all."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    see_ray_gpus_only(gpu_ids=lambda: ["2"], driver_initialized=lambda: False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3", "without the switch Ray set the variable itself"
    monkeypatch.setenv(NOSET_VISIBLE_DEVICES, "1")
    see_ray_gpus_only(gpu_ids=lambda: [], driver_initialized=lambda: False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3", "a spare takes a dead rank's GPUs later"
    see_ray_gpus_only(gpu_ids=lambda: ["2"], driver_initialized=lambda: True)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "CUDA already started" in caplog.text
    see_ray_gpus_only(gpu_ids=lambda: ["2"], driver_initialized=lambda: False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2" and devices.visible_devices() == "2"


def test_take_devices_refuses_another_node_or_an_initialised_driver(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(DevicesUnavailable, match="on node n2, this process runs on node n1"):
        take_devices("GPU-bbbb", "n2", "n1", driver_initialized=lambda: False)
    # CUDA initialised here on device 0 only (no CUDA in this torch: it lists no device at all).
    with pytest.raises(DevicesUnavailable, match="already initialised .* on CUDA_VISIBLE_DEVICES=0, which does not"):
        take_devices("GPU-bbbb", "n1", "n1", driver_initialized=lambda: True)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0", "a refusal changes nothing"


def test_a_spare_whose_driver_is_initialised_computes_on_the_rank_s_gpus_by_uuid(monkeypatch, caplog):
    """A library's start-up question to CUDA initialised the spare's driver with every GPU of the
    node visible (CUDA_VISIBLE_DEVICES unset): it computes on the dead rank's GPU through that
    GPU's index in its own CUDA order (here not NVML's), found by UUID, and says so in its pings."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_TAKEN", {})
    nvml = FakeNVML([FakeGpu(uuid=f"GPU-{c * 4}") for c in "abc"])  # NVML's order: a, b, c
    monkeypatch.setattr(torch.cuda, "init", lambda: None)  # no CUDA in this torch
    monkeypatch.setattr(devices._nvml_lookup, "cuda_device_uuids", lambda: ["GPU-cccc", "GPU-aaaa", "GPU-bbbb"])
    with_nvml = lambda value: devices.cuda_indices_of(value, nvml=nvml)  # noqa: E731
    assert with_nvml("1") == [2] and with_nvml("GPU-aaaa,2") == [1, 0]
    monkeypatch.setattr(devices._nvml_lookup, "cuda_device_uuids", lambda: ["GPU-cccc"])
    with pytest.raises(DevicesUnavailable, match="does not show it 1"):  # CUDA sees only c here
        take_devices("1", "n1", "n1", driver_initialized=lambda: True, cuda_indices=with_nvml)
    assert devices.visible_devices() is None and devices.taken_cuda_indices() is None, "a refusal changes nothing"
    monkeypatch.setattr(devices._nvml_lookup, "cuda_device_uuids", lambda: ["GPU-cccc", "GPU-aaaa", "GPU-bbbb"])
    current = []
    take_devices("1", "n1", "n1", driver_initialized=lambda: True, cuda_indices=with_nvml, set_device=current.append)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ, "CUDA read the variable already: it is left alone"
    assert devices.visible_devices() == "1" and devices.taken_cuda_indices() == [2]
    # Made current at once: a split rollout rank builds its model without a rendezvous, on CUDA's
    # current device, which would otherwise stay device 0 (another rank's GPU).
    assert current == [2]
    assert cuda_device_index(0) == 2, "the rendezvous selects the rank's GPU"
    # Health replies (from another thread, whose CUDA current device is its own) name that GPU too.
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setitem(worker._PG_STATE, "cuda_device", None)
    assert worker.compute_cuda_device() == 2
    take_devices("1", "n1", "n1", driver_initialized=lambda: True, cuda_indices=lambda value: None)  # its own now

    # Which start-up work initialised the driver of a process not yet given devices is logged, once.
    monkeypatch.setattr(devices, "_TAKEN", {})
    monkeypatch.setattr(devices, "_NOTED", [])
    monkeypatch.setattr(devices, "cuda_driver_initialized", lambda: True)
    caplog.clear()  # the hand-over above logs too where another test left the package's logger at INFO
    with caplog.at_level("INFO", logger=devices.__name__):
        devices.note_driver_initialised("the start-up work 'warm-imports'", before=True)  # it was before
        devices.note_driver_initialised("the start-up work 'warm-imports'", before=False)
        devices.note_driver_initialised("the start-up work 'warm-worker-imports'", before=False)
    assert [r.getMessage() for r in caplog.records] == [
        "the start-up work 'warm-imports' initialised the CUDA driver in this process (CUDA_VISIBLE_DEVICES=None)"]
    monkeypatch.setattr(devices, "_NOTED", [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a rank: its rendezvous initialises CUDA beside its start-up work
    caplog.clear()
    with caplog.at_level("INFO", logger=devices.__name__):
        devices.note_driver_initialised("the start-up work 'warm-imports'", before=False)
    assert caplog.records == []


def test_the_driver_probe_initialises_nothing():
    # No CUDA driver on this machine: never initialised. (On a GPU machine the probe asks the
    # driver, which answers CUDA_ERROR_NOT_INITIALIZED until cuInit has run.)
    assert devices.cuda_driver_initialized() is False


def test_a_role_worker_decides_its_device_at_first_use(tmp_path):
    assert uses_cuda("cpu") is False and uses_cuda("auto") is False
    with pytest.raises(ConfigError, match="trainer.device must be auto, cpu or cuda"):
        uses_cuda("tpu")
    cfg = load_config(None, ["trainer.device=cpu"])
    from resilient_rl.config.schema import config_to_dict

    worker = ActorWorker.__ray_actor_class__(config_to_dict(cfg), 16, 1, 0)
    assert worker._plan is None, "the constructor leaves the device to the first build"
    assert worker.plan.device.type == "cpu" and worker.plan is worker.plan


def test_a_role_build_says_how_long_it_took_and_waited_for_the_start_up_imports(monkeypatch, caplog):
    """A recovery's rejoin is mostly the rebuild of the restarted ranks' roles: each build logs its
    time, and the part of it spent waiting for the process's start-up imports."""
    import types
    from resilient_rl.config.schema import config_to_dict
    from resilient_rl.workers import roles

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    clock = [100.0]  # the build's own clock: only the wait for the start-up imports moves it
    monkeypatch.setattr(roles, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(roles, "wait_warm_up", lambda: clock.__setitem__(0, clock[0] + 4.5))
    cfg = load_config(None, ["trainer.device=cpu"])
    actor = ActorWorker.__ray_actor_class__(config_to_dict(cfg), 16, 1, 0)
    with caplog.at_level("INFO", logger=roles.__name__):
        assert actor.init_model(empty=True) is True
    assert [r.getMessage() for r in caplog.records if r.name == roles.__name__] == [
        "actor rank 0 built empty in 4.50 s (4.50 s of it waiting for the start-up imports)"]


# ---------------------------------------------------------------------------- spares on Ray

@pytest.fixture(scope="module")
def gpu_cluster():
    """A local Ray cluster with 2 logical GPUs (no CUDA): shut down after the module. Its worker
    processes given no GPU get ``CUDA_VISIBLE_DEVICES=""``, as older Ray releases give them by
    default, and every process is told to leave the variable alone, as on clusters started with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (OpenRLHF's scripts start theirs so)."""
    ray.init(address="local", num_cpus=16, num_gpus=2, include_dashboard=False, namespace="rrl-gpu-spares",
             object_store_memory=128 * 1024**2, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {OVERRIDE_ON_ZERO: "1", NOSET_VISIBLE_DEVICES: "1"}})
    try:
        yield ray
    finally:
        ray.shutdown()


def _gpu_group(prefix: str) -> RayWorkerGroup:
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1, name_prefix=prefix, cpus_per_bundle=0.1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, scale=1.0), max_restarts=2, call_timeout_s=60)


@pytest.mark.ray
def test_a_gpu_spare_starts_with_every_gpu_taken_and_takes_the_dead_rank_s_gpu(gpu_cluster):
    wg = _gpu_group("gpuspare")
    pool = SparePool(wg, 1, timeout_s=30)
    try:
        before = wg.ping()
        assert sorted(i.devices for i in before) == ["0", "1"], "Ray gave each rank one GPU, and said which"
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the spare to start")
        assert ray.available_resources().get("GPU", 0) == 0, "the spare reserves no GPU"
        spare = ray.get(pool._spares[0].handle.ping.remote())
        assert spare.node_id == before[1].node_id
        assert spare.devices is None, "the spare sees every GPU of its node, not none (CUDA_VISIBLE_DEVICES unset)"

        os.kill(before[1].pid, signal.SIGKILL)
        info = pool.adopt(1)
        assert info is not None and info.pid == spare.pid and info.rank == 1
        assert info.devices == before[1].devices, "the spare computes on the dead rank's GPU"
        assert wg.ranks.placement(1) == (before[1].node_id, before[1].devices)
        wg.init_process_group(generation=1, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]

        # Ray restarts the replaced process in rank 1's bundle, with its GPU: the next spare.
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the replaced process to come back as a spare")
        home = pool._spares[0].handle
        assert wg.ranks.is_bundle_process(home) and ray.get(home.ping.remote()).devices == before[1].devices
        # The spare serving rank 1 is gone for good (as with its node): the process of rank 1's
        # own bundle serves it again, and leaves the pool.
        ray.kill(wg.workers[1], no_restart=True)
        wait_until(lambda: ray.get(wg.workers[0].ping.remote()) and health.permanently_dead(wg) == [1], 30, 0.2,
                   "Ray to give up on the spare")
        infos = reidentify(wg, health.wait_alive(wg, 30))
        assert wg.workers[1] is home and [i.rank for i in infos] == [0, 1]
        assert infos[1].devices == before[1].devices
        pool.ready()
        assert all(s.handle is not home for s in pool._spares), "a process serving a rank is no spare"
        wg.init_process_group(generation=2, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
    finally:
        pool.shutdown()
        wg.shutdown()


@pytest.mark.ray
def test_a_spare_that_cannot_take_the_gpus_changes_nothing(gpu_cluster):
    wg = _gpu_group("gpurefuse")
    pool = SparePool(wg, 1, timeout_s=30)
    try:
        wait_until(lambda: len(pool.ready()) == 1, 60, 0.2, "the spare to start")
        handles = list(wg.workers)
        node, gpus = wg.ranks.placement(1)
        wg.ranks.placements[1] = ("a-lost-node", gpus)  # rank 1 ran on a node this spare is not on
        assert pool.adopt(1) is None and wg.workers == handles
        wait_until(lambda: len(pool.ready()) == 1, 30, 0.2, "the refusing spare to be ready again")
        assert ray.get(pool._spares[0].handle.ping.remote()).rank == 0, "it kept a spare's identity"
        wg.ranks.placements[1] = (node, gpus)
        assert pool.adopt(1).devices == gpus
    finally:
        pool.shutdown()
        wg.shutdown()
