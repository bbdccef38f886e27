"""CUDA devices matched to NVML devices by UUID.

NVML numbers GPUs in PCI bus order, CUDA fastest first: on a machine of mixed GPUs, integer
``CUDA_VISIBLE_DEVICES`` entries index CUDA's order, not NVML's. Here NVML device 0 is a slower
board on the first PCI bus, and CUDA's device 0 is the faster board at NVML index 1.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from resilient_rl import nvml
from resilient_rl.runtime.devices import device_report, visible_gpu_uuids
from resilient_rl.telemetry.device import GpuSampler
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML

SLOW = "GPU-aaaaaaaa-0000-0000-0000-000000000000"   # PCI bus 0: NVML index 0
FAST = "GPU-bbbbbbbb-0000-0000-0000-000000000000"   # PCI bus 1: NVML index 1, CUDA index 0
PCI_ORDER = [SLOW, FAST]
CUDA_ORDER = [FAST, SLOW]


def _mixed_machine() -> FakeNVML:
    return FakeNVML([FakeGpu(uuid=SLOW, utilization_percent=10), FakeGpu(uuid=FAST, utilization_percent=90)])


class _Uuid:
    """torch's ``_CUuuid``: printed without NVML's ``GPU-`` prefix."""

    def __init__(self, uuid: str) -> None:
        self.text = uuid.removeprefix("GPU-")

    def __str__(self) -> str:
        return self.text


def _fake_torch(visible: list[str] | None, initialized: bool = True):
    cuda = SimpleNamespace(
        is_initialized=lambda: initialized,
        device_count=lambda: len(visible or []),
        get_device_properties=lambda i: SimpleNamespace(uuid=_Uuid(visible[i])),
    )
    return SimpleNamespace(cuda=cuda)


def test_cuda_uuids_come_from_torch_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(CUDA_ORDER))
    assert nvml.cuda_device_uuids() == CUDA_ORDER


def test_cuda_uuids_are_unknown_before_cuda_is_initialised(monkeypatch):
    # Reading them would initialise CUDA: a warm spare must stay free to take other devices.
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(CUDA_ORDER, initialized=False))
    assert nvml.cuda_device_uuids() is None
    monkeypatch.delitem(sys.modules, "torch")
    assert nvml.cuda_device_uuids() is None


def test_cuda_uuids_are_unknown_where_torch_has_no_uuid(monkeypatch):
    fake = _fake_torch(CUDA_ORDER)
    fake.cuda.get_device_properties = lambda i: SimpleNamespace()
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert nvml.cuda_device_uuids() is None


def test_resolve_matches_by_uuid_where_cuda_order_differs():
    assert nvml.resolve_visible_devices(["0"], PCI_ORDER, [FAST]) == [1]
    assert nvml.resolve_visible_devices(None, PCI_ORDER, CUDA_ORDER) == [1, 0]
    # A UUID NVML does not list (a MIG instance, say): the variable's entries decide.
    assert nvml.resolve_visible_devices(["0"], PCI_ORDER, ["GPU-cccc"]) == [0]
    assert nvml.resolve_visible_devices(["0"], PCI_ORDER, None) == [0]


def test_worker_reports_the_gpu_cuda_computes_on(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # Ray gave the process CUDA's device 0
    monkeypatch.setattr(nvml, "cuda_device_uuids", lambda: [FAST])
    assert visible_gpu_uuids(_mixed_machine()) == (FAST,)
    assert device_report(0, nvml=_mixed_machine()).gpu_uuids == (FAST,)


def test_sampler_reads_the_gpu_cuda_computes_on(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(nvml, "cuda_device_uuids", lambda: [FAST])
    samples = GpuSampler(nvml=_mixed_machine()).sample()
    assert [(s.index, s.uuid, s.utilization_ratio) for s in samples] == [(0, FAST, 0.9)]


def test_sampler_started_before_cuda_remaps_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    known: list[list[str] | None] = [None]
    monkeypatch.setattr(nvml, "cuda_device_uuids", lambda: known[0])
    sampler = GpuSampler(nvml=_mixed_machine())
    assert sampler.devices == [(0, SLOW)]  # the best guess before CUDA can say
    known[0] = [FAST]
    assert [(s.index, s.uuid) for s in sampler.sample()] == [(0, FAST)]
    assert sampler.devices == [(0, FAST)]


def test_per_node_sampler_keeps_nvml_indices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(nvml, "cuda_device_uuids", lambda: [FAST])
    sampler = GpuSampler(nvml=_mixed_machine(), all_devices=True)
    assert sampler.devices == list(enumerate(PCI_ORDER))
