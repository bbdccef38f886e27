"""Per-GPU and per-process series of one node: NVML readings labelled with the roles and ranks that
compute on each GPU, and CPU and memory of the worker processes (what a CPU-only node exports)."""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from resilient_rl.telemetry.device import GpuSampler, ProcessSampler


def _normalize_uuid(uuid: str) -> str:
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


class DeviceMetrics(Collector):
    """Per-node device series, read on every scrape.

    GPU series carry ``node``, ``gpu`` (CUDA index), ``uuid`` and the ``role``/``rank`` of the
    worker process(es) computing on the GPU (empty while unassigned; several roles of one
    process are ``+``-joined, see :mod:`resilient_rl.telemetry.gpu_owners`). A reading NVML cannot take is left out, and without
    NVML there is no GPU series at all. Process series cover the pids given to
    :meth:`set_processes`.

    Args:
        registry: where to register; None creates a private registry (see ``.registry``).
        node: this node's name, the ``node`` label.
        gpu_sampler: None creates a :class:`GpuSampler` over the real NVML, if any.
        process_sampler: None creates an empty :class:`ProcessSampler`.
    """

    _GPU_LABELS = ["node", "gpu", "uuid", "role", "rank"]
    _PROC_LABELS = ["role", "rank", "node"]
    # (series name, help, GpuSample field)
    _GPU_SERIES = (
        ("rrl_gpu_utilization_ratio", "Share of time a kernel was running on the GPU.",
         "utilization_ratio"),
        ("rrl_gpu_memory_used_bytes", "GPU memory in use.", "memory_used_bytes"),
        ("rrl_gpu_memory_total_bytes", "GPU memory installed.", "memory_total_bytes"),
        ("rrl_gpu_power_watts", "GPU power draw.", "power_watts"),
        ("rrl_gpu_temperature_celsius", "GPU core temperature.", "temperature_celsius"),
        ("rrl_gpu_sm_clock_hertz", "GPU streaming-multiprocessor clock.", "sm_clock_hertz"),
    )

    def __init__(self, registry: CollectorRegistry | None = None, node: str = "localhost",
                 gpu_sampler: GpuSampler | None = None,
                 process_sampler: ProcessSampler | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.node = node
        self.gpu_sampler = gpu_sampler if gpu_sampler is not None else GpuSampler()
        self.process_sampler = process_sampler if process_sampler is not None else ProcessSampler()
        self._lock = threading.Lock()
        self._assignments: dict[str, tuple[str, str]] = {}
        self.registry.register(self)

    def assign_gpus(self, assignments: Mapping[str, tuple[str, int | str]]) -> None:
        """Set which (role, rank) uses each GPU, keyed by UUID (with or without ``GPU-``); the
        GPUs left out are unassigned. Labels of shared GPUs come from
        :func:`~resilient_rl.telemetry.gpu_owners.gpu_assignments` (e.g. ``actor+ref+rollout``)."""
        with self._lock:
            self._assignments = {_normalize_uuid(uuid): (role, str(rank))
                                 for uuid, (role, rank) in assignments.items()}

    def set_processes(self, pids: Mapping[tuple[str, int], int]) -> None:
        """Set the worker processes on this node, keyed by (role, rank)."""
        self.process_sampler.set_pids(pids)

    def describe(self) -> Iterable[Metric]:
        # Lets the registry reject duplicate names without sampling devices at registration.
        for name, doc, _ in self._GPU_SERIES:
            yield GaugeMetricFamily(name, doc, labels=self._GPU_LABELS)
        yield from self._process_families()

    def collect(self) -> Iterable[Metric]:
        families = [(GaugeMetricFamily(name, doc, labels=self._GPU_LABELS), field)
                    for name, doc, field in self._GPU_SERIES]
        with self._lock:
            assignments = dict(self._assignments)
        for sample in self.gpu_sampler.sample():
            role, rank = assignments.get(sample.uuid, ("", ""))
            labels = [self.node, str(sample.index), sample.uuid, role, rank]
            for family, field in families:
                value = getattr(sample, field)
                if value is not None:
                    family.add_metric(labels, float(value))
        for family, _ in families:
            if family.samples:
                yield family
        cpu, rss = self._process_families()
        for proc in self.process_sampler.sample():
            labels = [proc.role, str(proc.rank), self.node]
            cpu.add_metric(labels, proc.cpu_seconds)
            rss.add_metric(labels, proc.resident_memory_bytes)
        if cpu.samples:
            yield cpu
            yield rss

    def _process_families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        return (CounterMetricFamily("rrl_process_cpu_seconds",
                                    "CPU time (user + system) of a worker process.",
                                    labels=self._PROC_LABELS),
                GaugeMetricFamily("rrl_process_resident_memory_bytes",
                                  "Resident memory of a worker process.",
                                  labels=self._PROC_LABELS))

    def close(self) -> None:
        """Stop exporting and release NVML."""
        self.registry.unregister(self)
        self.gpu_sampler.close()
