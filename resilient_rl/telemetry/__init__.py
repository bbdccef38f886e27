"""Telemetry: metric definitions, Prometheus exporter, device sampler."""

from resilient_rl.telemetry.device import GpuSample, GpuSampler, ProcessSample, ProcessSampler
from resilient_rl.telemetry.exporter import MetricsServer, sample_value, sample_values, scrape
from resilient_rl.telemetry.file_sd import FileSDWriter
from resilient_rl.runtime.devices import DeviceReport, device_report
from resilient_rl.telemetry.gpu_owners import ProcessDevices, TorchMemoryMetrics, gpu_assignments
from resilient_rl.telemetry.device_metrics import DeviceMetrics
from resilient_rl.telemetry.metrics import LOSS_KINDS, PHASE_LABELS, PHASES, TrainerMetrics
from resilient_rl.telemetry.node_exporter import NodeExporter

__all__ = [
    "DeviceMetrics",
    "DeviceReport",
    "FileSDWriter",
    "GpuSample",
    "GpuSampler",
    "LOSS_KINDS",
    "MetricsServer",
    "NodeExporter",
    "PHASES",
    "PHASE_LABELS",
    "ProcessDevices",
    "ProcessSample",
    "ProcessSampler",
    "TorchMemoryMetrics",
    "TrainerMetrics",
    "device_report",
    "gpu_assignments",
    "sample_value",
    "sample_values",
    "scrape",
]
