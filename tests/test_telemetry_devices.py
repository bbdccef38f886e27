"""Telemetry of the devices and processes: GPU sampling through a fake NVML (CUDA_VISIBLE_DEVICES
mapped to UUIDs, unsupported and lost readings, a reading reused for its maximum age), process
sampling, and the node exporter that serves both (the exporter and the trainer's series:
tests/test_telemetry.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resilient_rl.errors import TelemetryError
from resilient_rl.telemetry import (DeviceMetrics, GpuSampler, MetricsServer, NodeExporter, ProcessSampler,
                                    TrainerMetrics, scrape)
from resilient_rl.telemetry.device import resolve_visible_devices
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML, NVMLError_LibraryNotFound
from resilient_rl.testing.scrape import samples, value

UUIDS = ["GPU-11111111-aaaa-0000-0000-000000000000",
         "GPU-22222222-bbbb-0000-0000-000000000000",
         "GPU-33333333-cccc-0000-0000-000000000000"]


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

