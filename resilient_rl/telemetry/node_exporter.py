"""One node's device exporter: GPU and worker-process readings on an endpoint of their own.

A run exports one device endpoint per node that hosts workers. The controller's node is served
by the controller's own exporter; every other node runs a :class:`NodeExporter`, placed there by
the trainer as a small Ray actor (see :mod:`resilient_rl.telemetry.hook`). This module
does not depend on Ray, so the exporter can be tested and used on its own.
"""

from __future__ import annotations

from typing import Any, Mapping

from resilient_rl.telemetry.device import GpuSampler, ProcessSampler
from resilient_rl.telemetry.exporter import MetricsServer
from resilient_rl.telemetry.device_metrics import DeviceMetrics

_WILDCARDS = ("", "0.0.0.0", "::")


class NodeExporter:
    """Serves :class:`DeviceMetrics` of one node (every GPU of the machine, the given workers).

    Args:
        node: the ``node`` label of the series.
        bind_address: interface to listen on (``0.0.0.0`` to be scraped from another host).
        port: TCP port, 0 for a free one.
        advertise_host: the host Prometheus should use when ``bind_address`` is a wildcard
            (the node's IP address); ignored otherwise.
        gpu_max_age_s: reuse a GPU reading for this long (``telemetry.gpu_sample_interval_s``).
        nvml: an NVML module for the GPU sampler (a test double); None imports ``pynvml``.
    """

    def __init__(self, node: str, bind_address: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, gpu_max_age_s: float = 0.0,
                 nvml: Any | None = None) -> None:
        # The exporter process is given no GPU of its own: sample every device of the machine.
        self.devices = DeviceMetrics(node=node,
                                     gpu_sampler=GpuSampler(nvml, all_devices=True,
                                                            max_age_s=gpu_max_age_s),
                                     process_sampler=ProcessSampler())
        self.server = MetricsServer(self.devices.registry, bind_address, port)
        self.advertise_host = advertise_host

    def start(self) -> str:
        """Start serving; returns the ``host:port`` Prometheus scrapes.

        Raises:
            TelemetryError: the address cannot be bound (the message names it).
        """
        self.server.start()
        if self.server.bind_address in _WILDCARDS and self.advertise_host:
            return f"{self.advertise_host}:{self.server.port}"
        return str(self.server.target)

    def set_processes(self, pids: Mapping[tuple[str, int], int]) -> None:
        """Set the worker processes of this node, keyed by (role, rank)."""
        self.devices.set_processes(pids)

    def set_gpu_assignments(self, assignments: Mapping[str, tuple[str, int | str]]) -> None:
        """Set the ``role``/``rank`` labels of this node's GPUs, keyed by UUID (GPUs left out
        are unassigned)."""
        self.devices.assign_gpus(assignments)

    def stop(self) -> None:
        """Stop serving and release NVML."""
        self.server.stop()
        self.devices.close()
