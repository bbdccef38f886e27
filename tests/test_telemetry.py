"""Telemetry: metrics scraped over HTTP from a live exporter, GPU sampling through a fake NVML,
process sampling, and the file_sd targets file (the trainer's telemetry hook:
tests/test_telemetry_hook.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from resilient_rl.errors import TelemetryError
from resilient_rl.telemetry import (PHASE_LABELS, DeviceMetrics, FileSDWriter, GpuSampler,
                                    MetricsServer, NodeExporter, ProcessSampler, TrainerMetrics,
                                    scrape)
from resilient_rl.telemetry.device import resolve_visible_devices
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML, NVMLError_LibraryNotFound
from resilient_rl.testing.scrape import names, samples, value

UUIDS = ["GPU-11111111-aaaa-0000-0000-000000000000",
         "GPU-22222222-bbbb-0000-0000-000000000000",
         "GPU-33333333-cccc-0000-0000-000000000000"]


class Clock:
    """A settable Unix clock, so ages are exact without sleeping."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def trainer(clock: Clock):
    metrics = TrainerMetrics(run="unit", clock=clock)
    with MetricsServer(metrics.registry) as server:
        yield metrics, server


def three_gpus(**overrides) -> FakeNVML:
    gpus = [FakeGpu(uuid=UUIDS[0], utilization_percent=75, memory_used_bytes=3 * 2**30,
                    memory_total_bytes=40 * 2**30, power_milliwatts=250_500,
                    temperature_celsius=61, sm_clock_mhz=1410),
            FakeGpu(uuid=UUIDS[1], utilization_percent=10),
            FakeGpu(uuid=UUIDS[2], utilization_percent=99)]
    for index, fields in overrides.items():
        for key, val in fields.items():
            setattr(gpus[int(index[1:])], key, val)
    return FakeNVML(gpus)


# -- exporter ------------------------------------------------------------------------------

def test_server_resolves_port_zero_and_serves_private_registry(trainer):
    metrics, server = trainer
    assert server.port and server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    data = samples(server.url)
    assert value(data, "rrl_run_info", run="unit") == 1.0
    assert value(data, "rrl_step") == 0.0
    # Only our registry: the global one's process_/python_ series are not served.
    assert all(name.startswith("rrl_") for name in names(data))


def test_port_in_use_raises_telemetry_error_naming_port():
    registry = TrainerMetrics().registry
    with MetricsServer(registry) as first:
        second = MetricsServer(registry, port=first.port)
        with pytest.raises(TelemetryError, match=rf"127\.0\.0\.1:{first.port}.*in use"):
            second.start()
        assert not second.running
        port = first.port
    # stop() released the port: a new server can bind it again.
    with MetricsServer(registry, port=port) as again:
        assert again.port == port
        assert value(samples(again.url), "rrl_step") == 0.0


def test_disabled_server_is_a_noop():
    server = MetricsServer(TrainerMetrics().registry, enabled=False)
    assert server.start() is server
    assert not server.running and server.port is None and server.url is None
    server.stop()


def test_unbindable_address_raises_telemetry_error():
    with pytest.raises(TelemetryError, match="203.0.113.7"):
        MetricsServer(TrainerMetrics().registry, bind_address="203.0.113.7").start()


# -- trainer metrics -----------------------------------------------------------------------

def test_observe_step_moves_gauges_counters_and_histograms(trainer):
    metrics, server = trainer
    metrics.observe_step(1, 0.2, {"gen": 0.12, "update_actor": 0.05}, tokens=512,
                         reward_mean=0.25, losses={"actor": 1.5}, kl=0.01, lr=1e-5)
    metrics.observe_step(2, 3.0, {"gen": 2.0, "update_actor": 0.7, "update_critic": 0.2},
                         tokens=488, reward_mean=0.5, losses={"actor": 1.25, "critic": 0.5},
                         kl=0.02, lr={"actor": 2e-5, "critic": 1e-4})
    data = samples(server.url)
    assert value(data, "rrl_step") == 2
    assert value(data, "rrl_step_duration_seconds_count") == 2
    assert value(data, "rrl_step_duration_seconds_sum") == pytest.approx(3.2)
    assert value(data, "rrl_step_duration_seconds_bucket", le="0.25") == 1
    assert value(data, "rrl_step_duration_seconds_bucket", le="2.5") == 1
    assert value(data, "rrl_step_duration_seconds_bucket", le="5.0") == 2
    assert value(data, "rrl_step_duration_seconds_bucket", le="+Inf") == 2
    assert value(data, "rrl_phase_duration_seconds_count", phase="gen") == 2
    assert value(data, "rrl_phase_duration_seconds_sum", phase="gen") == pytest.approx(2.12)
    assert value(data, "rrl_phase_duration_seconds_count", phase="update_critic") == 1
    # Every phase is exported from the start, so rate() over it never lacks a series.
    for phase in PHASE_LABELS:
        assert value(data, "rrl_phase_duration_seconds_count", phase=phase) is not None
    assert value(data, "rrl_tokens_total") == 1000
    assert value(data, "rrl_reward_mean") == 0.5
    assert value(data, "rrl_actor_loss") == 1.25
    assert value(data, "rrl_critic_loss") == 0.5
    assert value(data, "rrl_kl") == 0.02
    assert value(data, "rrl_learning_rate", role="actor") == 2e-5
    assert value(data, "rrl_learning_rate", role="critic") == 1e-4


def test_signals_absent_until_reported(trainer):
    metrics, server = trainer
    metrics.observe_step(1, 0.1, losses={"actor": 0.3})
    data = names(samples(server.url))
    assert "rrl_actor_loss" in data
    assert not {"rrl_critic_loss", "rrl_reward_mean", "rrl_kl", "rrl_goodput_ratio",
                "rrl_learning_rate"} & data
    metrics.set_goodput(useful_s=90.0, wall_s=120.0)
    assert value(samples(server.url), "rrl_goodput_ratio") == 0.75


def test_observe_step_rejects_unknown_phase_loss_and_negative_values(trainer):
    metrics, server = trainer
    with pytest.raises(TelemetryError, match="'rollout'"):
        metrics.observe_step(1, 0.1, {"rollout": 0.1})
    with pytest.raises(TelemetryError, match="'value'"):
        metrics.observe_step(1, 0.1, losses={"value": 0.1})
    with pytest.raises(TelemetryError, match="tokens"):
        metrics.observe_step(1, 0.1, tokens=-5)
    # Nothing was half-recorded by the rejected calls.
    data = samples(server.url)
    assert value(data, "rrl_step_duration_seconds_count") == 0
    assert value(data, "rrl_tokens_total") == 0


def test_workers_restarts_failures_and_recoveries(trainer):
    metrics, server = trainer
    metrics.set_workers_up("actor", 0, "n0", True)
    metrics.set_workers_up("actor", 1, "n0", True)
    metrics.set_workers_up("actor", 1, "n0", False)
    metrics.record_failure("died")
    metrics.record_restart("actor", 1, "died")
    metrics.record_restart("actor", 1, "died")
    metrics.record_restart("critic", 0, "timeout")
    metrics.record_recovery(duration_s=7.5, steps_replayed=3)
    metrics.record_recovery(duration_s=40.0, steps_replayed=2)
    data = samples(server.url)
    assert value(data, "rrl_worker_up", role="actor", rank="0", node="n0") == 1
    assert value(data, "rrl_worker_up", role="actor", rank="1", node="n0") == 0
    assert value(data, "rrl_worker_restarts_total", role="actor", rank="1", cause="died") == 2
    assert value(data, "rrl_worker_restarts_total", role="critic", rank="0", cause="timeout") == 1
    assert value(data, "rrl_failures_total", cause="died") == 1
    assert value(data, "rrl_recoveries_total") == 2
    assert value(data, "rrl_steps_replayed_total") == 5
    assert value(data, "rrl_recovery_duration_seconds_count") == 2
    assert value(data, "rrl_recovery_duration_seconds_bucket", le="10.0") == 1
    assert value(data, "rrl_recovery_duration_seconds_bucket", le="60.0") == 2

    # The replacement of actor 1 runs on another node: the old series must disappear, or
    # the worker-down alert would fire forever on a 0 nobody updates.
    metrics.set_workers_up("actor", 1, "n1", True)
    data = samples(server.url)
    assert value(data, "rrl_worker_up", role="actor", rank="1", node="n0") is None
    assert value(data, "rrl_worker_up", role="actor", rank="1", node="n1") == 1
    metrics.remove_worker("actor", 1)
    assert value(samples(server.url), "rrl_worker_up", role="actor", rank="1", node="n1") is None


def test_checkpoint_series_and_age(trainer, clock):
    metrics, server = trainer
    clock.now += 120
    data = samples(server.url)
    # No commit yet: step and timestamp absent, age counts from the start.
    assert value(data, "rrl_checkpoint_last_committed_step") is None
    assert value(data, "rrl_checkpoint_last_committed_timestamp_seconds") is None
    assert value(data, "rrl_checkpoint_age_seconds") == 120

    metrics.record_checkpoint_save(duration_s=4.0, stall_s=0.3, nbytes=1_000_000, step=10)
    committed = clock.now
    clock.now += 30
    metrics.record_checkpoint_save(duration_s=6.0, stall_s=0.2, nbytes=500_000, step=20)
    clock.now += 45
    metrics.record_checkpoint_load(duration_s=0.4)
    metrics.record_corrupt_checkpoint()
    metrics.record_corrupt_snapshot("node")
    data = samples(server.url)
    assert value(data, "rrl_checkpoint_last_committed_step") == 20
    assert value(data, "rrl_checkpoint_last_committed_timestamp_seconds") == committed + 30
    assert value(data, "rrl_checkpoint_age_seconds") == 45
    assert metrics.checkpoint_age() == 45
    assert value(data, "rrl_checkpoint_save_duration_seconds_count") == 2
    assert value(data, "rrl_checkpoint_save_duration_seconds_sum") == 10.0
    assert value(data, "rrl_checkpoint_stall_seconds_sum") == pytest.approx(0.5)
    assert value(data, "rrl_checkpoint_load_duration_seconds_count") == 1
    assert value(data, "rrl_checkpoint_bytes_total") == 1_500_000
    assert value(data, "rrl_checkpoint_corrupt_total") == 1
    assert value(data, "rrl_snapshot_corrupt_total", source="node") == 1

    # A resumed run reports the checkpoint it started from.
    metrics.set_last_committed(step=7, timestamp=clock.now - 600)
    assert value(samples(server.url), "rrl_checkpoint_age_seconds") == 600


# -- GPU sampling --------------------------------------------------------------------------

def test_gpu_sampler_reads_fake_nvml_in_base_units(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = GpuSampler(nvml=three_gpus())
    assert sampler.available
    got = sampler.sample()
    assert [(s.index, s.uuid) for s in got] == list(enumerate(UUIDS))
    first = got[0]
    assert first.utilization_ratio == 0.75
    assert first.memory_used_bytes == 3 * 2**30
    assert first.memory_total_bytes == 40 * 2**30
    assert first.power_watts == pytest.approx(250.5)
    assert first.temperature_celsius == 61
    assert first.sm_clock_hertz == 1.41e9


@pytest.mark.parametrize("visible, expected", [
    ("1,0", [UUIDS[1], UUIDS[0]]),
    (f"{UUIDS[2]},{UUIDS[0]}", [UUIDS[2], UUIDS[0]]),
    ("GPU-33333333,GPU-11111111", [UUIDS[2], UUIDS[0]]),
    ("22222222-bbbb", [UUIDS[1]]),
    ("2,7,0", [UUIDS[2]]),          # CUDA stops at the first invalid entry
    ("GPU-,1", []),                  # an ambiguous prefix is invalid too
    ("", []),
])
def test_cuda_visible_devices_maps_cuda_index_to_uuid(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    got = GpuSampler(nvml=three_gpus()).sample()
    assert [(s.index, s.uuid) for s in got] == list(enumerate(expected))


def test_all_devices_ignores_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    sampler = GpuSampler(nvml=three_gpus(), all_devices=True)
    assert sampler.devices == list(enumerate(UUIDS))


def test_resolve_visible_devices_counts_a_device_once():
    assert resolve_visible_devices(["1", UUIDS[1], "0"], UUIDS) == [1, 0]


def test_device_metrics_export_gpus_with_assignment_and_omit_unsupported(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    nvml = three_gpus(g0={"unsupported": {"power", "sm_clock"}})
    devices = DeviceMetrics(node="n0", gpu_sampler=GpuSampler(nvml=nvml))
    devices.assign_gpus({UUIDS[0].removeprefix("GPU-"): ("actor", 1), UUIDS[1]: ("actor", 0)})
    with MetricsServer(devices.registry) as server:
        data = samples(server.url)
        gpu0 = dict(node="n0", gpu="0", uuid=UUIDS[1], role="actor", rank="0")
        gpu1 = dict(node="n0", gpu="1", uuid=UUIDS[0], role="actor", rank="1")
        assert value(data, "rrl_gpu_utilization_ratio", **gpu0) == 0.10
        assert value(data, "rrl_gpu_utilization_ratio", **gpu1) == 0.75
        assert value(data, "rrl_gpu_memory_used_bytes", **gpu1) == 3 * 2**30
        assert value(data, "rrl_gpu_memory_total_bytes", **gpu1) == 40 * 2**30
        assert value(data, "rrl_gpu_temperature_celsius", **gpu1) == 61
        assert value(data, "rrl_gpu_power_watts", **gpu0) == 300.0
        # Not supported on the first NVML device: absent, not zero.
        assert value(data, "rrl_gpu_power_watts", **gpu1) is None
        assert value(data, "rrl_gpu_sm_clock_hertz", **gpu1) is None
        assert len([k for k in data if k[0] == "rrl_gpu_power_watts"]) == 1

        # Readings are taken at scrape time.
        nvml.gpus[1].utilization_percent = 55
        assert value(samples(server.url), "rrl_gpu_utilization_ratio", **gpu0) == 0.55
        # A GPU that falls off the bus loses its readings without breaking the scrape.
        nvml.gpus[1].lost = True
        data = samples(server.url)
        assert value(data, "rrl_gpu_utilization_ratio", **gpu0) is None
        assert value(data, "rrl_gpu_utilization_ratio", **gpu1) == 0.75


def test_without_nvml_no_gpu_series_at_all():
    # Library present but unusable (no driver): the sampler disables itself.
    broken = FakeNVML([FakeGpu(uuid=UUIDS[0])], init_error=NVMLError_LibraryNotFound)
    sampler = GpuSampler(nvml=broken)
    assert not sampler.available and sampler.sample() == []
    devices = DeviceMetrics(node="n0", gpu_sampler=sampler,
                            process_sampler=ProcessSampler({("actor", 0): os.getpid()}))
    trainer = TrainerMetrics(registry=devices.registry)
    trainer.observe_step(1, 0.1)
    with MetricsServer(devices.registry) as server:
        text = scrape(server.url)
    assert "rrl_gpu_" not in text
    assert "rrl_process_resident_memory_bytes" in text


def test_real_nvml_absent_on_this_machine_exports_no_gpu_series():
    sampler = GpuSampler()
    if sampler.available:
        pytest.skip("this machine has NVML devices")
    devices = DeviceMetrics(node="n0", gpu_sampler=sampler)
    with MetricsServer(devices.registry) as server:
        assert "rrl_gpu_" not in scrape(server.url)


# -- process sampling ----------------------------------------------------------------------

def test_process_sampler_reports_this_process_and_skips_exited_ones():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    sampler = ProcessSampler({("actor", 0): os.getpid(), ("actor", 1): child.pid})
    got = sampler.sample()
    assert [(s.role, s.rank, s.pid) for s in got] == [("actor", 0, os.getpid())]
    assert got[0].resident_memory_bytes > 0
    assert got[0].cpu_seconds > 0

    devices = DeviceMetrics(node="n0", gpu_sampler=GpuSampler(nvml=FakeNVML([])),
                            process_sampler=sampler)
    devices.set_processes({("rollout", 2): os.getpid()})
    with MetricsServer(devices.registry) as server:
        data = samples(server.url)
    labels = dict(role="rollout", rank="2", node="n0")
    assert value(data, "rrl_process_resident_memory_bytes", **labels) > 0
    assert value(data, "rrl_process_cpu_seconds_total", **labels) > 0
    assert value(data, "rrl_process_cpu_seconds_total", role="actor", rank="0", node="n0") is None


# -- file_sd -------------------------------------------------------------------------------

def test_file_sd_writer_keeps_targets_file_current(tmp_path):
    path = tmp_path / "targets" / "run1.json"
    writer = FileSDWriter(path)
    writer.update([("10.0.0.5:9400", {"job": "resilient-rl", "run": "run1", "node": "n0"}),
                   ("10.0.0.6:9400", {"job": "resilient-rl", "run": "run1", "node": "n1"})])
    groups = json.loads(path.read_text())
    assert sorted((g["targets"], g["labels"]["node"]) for g in groups) == [
        (["10.0.0.5:9400"], "n0"), (["10.0.0.6:9400"], "n1")]

    writer.add("[::1]:9401", {"job": "resilient-rl", "run": "run1", "node": "n1"})
    writer.remove("10.0.0.5:9400")
    groups = json.loads(path.read_text())
    assert groups == [{"targets": ["10.0.0.6:9400", "[::1]:9401"],
                       "labels": {"job": "resilient-rl", "run": "run1", "node": "n1"}}]
    # Written through a temporary file that never lingers next to the targets.
    assert sorted(p.name for p in path.parent.iterdir()) == ["run1.json"]
    assert oct(path.stat().st_mode & 0o777) == "0o644"

    writer.close()
    assert not path.exists()


@pytest.mark.parametrize("target, labels, match", [
    ("localhost", {}, "host:port"),
    ("localhost:99999", {}, "host:port"),
    ("localhost:9400", {"__address__": "x"}, "__address__"),
    ("localhost:9400", {"bad-name": "x"}, "bad-name"),
    ("localhost:9400", {"rank": 3}, "'rank' must be a string"),
])
def test_file_sd_writer_rejects_bad_targets(tmp_path, target, labels, match):
    writer = FileSDWriter(tmp_path / "t.json")
    with pytest.raises(TelemetryError, match=match):
        writer.add(target, labels)
    assert not (tmp_path / "t.json").exists()


def test_file_sd_path_must_match_prometheus_glob(tmp_path):
    with pytest.raises(TelemetryError, match=r"\.json"):
        FileSDWriter(tmp_path / "targets.yml")


def test_gpu_sampler_reuses_a_reading_for_max_age(monkeypatch, clock):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = three_gpus()
    sampler = GpuSampler(nvml=nvml, max_age_s=5.0, clock=clock)
    assert sampler.sample()[0].utilization_ratio == 0.75
    nvml.gpus[0].utilization_percent = 20
    clock.now += 4.9
    assert sampler.sample()[0].utilization_ratio == 0.75
    clock.now += 0.2
    assert sampler.sample()[0].utilization_ratio == 0.2


# -- node exporter -------------------------------------------------------------------------

def test_node_exporter_serves_processes_and_advertises_its_host():
    exporter = NodeExporter("n7", bind_address="0.0.0.0", advertise_host="10.1.2.3")
    target = exporter.start()
    try:
        assert target == f"10.1.2.3:{exporter.server.port}"
        exporter.set_processes({("critic", 1): os.getpid()})
        data = samples(exporter.server.url)
        assert value(data, "rrl_process_cpu_seconds_total", role="critic", rank="1", node="n7") > 0
        busy = NodeExporter("n8", port=exporter.server.port)
        with pytest.raises(TelemetryError, match=f"port {exporter.server.port} is already in use"):
            busy.start()
    finally:
        exporter.stop()


def test_observe_phase_records_a_known_phase_only(trainer):
    metrics, server = trainer
    metrics.observe_phase("checkpoint", 0.25)
    with pytest.raises(TelemetryError, match="'save'"):
        metrics.observe_phase("save", 0.1)
    with pytest.raises(TelemetryError, match="checkpoint"):
        metrics.observe_phase("checkpoint", -1.0)
    data = samples(server.url)
    assert value(data, "rrl_phase_duration_seconds_count", phase="checkpoint") == 1
    assert value(data, "rrl_phase_duration_seconds_sum", phase="checkpoint") == 0.25


def test_useful_time_is_a_running_total_that_rolls_back():
    from resilient_rl.telemetry.goodput import UsefulTime

    u = UsefulTime()
    for step, seconds in ((1, 1.0), (2, 2.0), (3, 4.0)):
        u.record(step, seconds)
    assert u.total == 7.0
    u.rollback(1)  # a recovery restored step 1: steps 2 and 3 are replayed
    assert u.total == 1.0
    u.record(2, 0.5)
    u.record(2, 0.25)  # recorded again: replaces, never double counts
    assert u.total == 1.25
