"""Telemetry: metric definitions, Prometheus exporter, device sampler.

The exports load on first use (:mod:`resilient_rl.lazy`): ``status`` reads the training-time
ledger (:mod:`~resilient_rl.telemetry.training_time`) and must not import the device samplers
and torch with it.
"""

from resilient_rl.lazy import lazy_exports

_EXPORTS = {
    "resilient_rl.telemetry.device": ("GpuSample", "GpuSampler", "ProcessSample", "ProcessSampler"),
    "resilient_rl.telemetry.exporter": ("MetricsServer", "sample_value", "sample_values", "scrape"),
    "resilient_rl.telemetry.file_sd": ("FileSDWriter",),
    "resilient_rl.runtime.devices": ("DeviceReport", "device_report"),
    "resilient_rl.telemetry.gpu_owners": ("ProcessDevices", "TorchMemoryMetrics", "gpu_assignments"),
    "resilient_rl.telemetry.device_metrics": ("DeviceMetrics",),
    "resilient_rl.telemetry.metrics": ("LOSS_KINDS", "PHASE_LABELS", "PHASES", "TrainerMetrics"),
    "resilient_rl.telemetry.node_exporter": ("NodeExporter",),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
