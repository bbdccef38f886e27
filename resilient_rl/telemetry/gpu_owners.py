"""Which worker computes on which GPU, and how much memory torch holds there.

NVML sees every GPU of a machine but not who uses it; a worker process knows its CUDA device but
not the device's NVML identity. The two meet on the GPU's UUID:

- the worker side (:func:`device_report`, called by ``Worker.ping``, so it also answers through
  the health concurrency group while a training call runs) maps the worker's CUDA index to a
  UUID through NVML and ``CUDA_VISIBLE_DEVICES`` and reads torch's allocator counters;
- the controller side (:func:`gpu_assignments`) turns the reports of every process into the
  ``role``/``rank`` labels of each GPU, per node, for the ``DeviceMetrics`` of the node where the
  GPU is; :class:`TorchMemoryMetrics` exports torch's memory per process.

Several roles in one process (the colocated placement) label their GPU with every role, sorted
and joined by ``+`` (``role="actor+ref+rollout"``): one series per GPU, whatever the placement.
Processes of different ranks sharing a GPU join their ranks the same way (``rank="0+1"``).
Without a GPU (or NVML) a worker reports no UUID and no torch counters, and no series appear.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from resilient_rl.runtime.devices import DeviceReport

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- controller side

def join_labels(values: Iterable[Any], numeric: bool = False) -> str:
    """A deterministic label for several roles (or ranks) sharing one device: sorted, ``+``-joined."""
    distinct = {str(v) for v in values}
    return "+".join(sorted(distinct, key=(lambda v: (len(v), v)) if numeric else None))


@dataclass(frozen=True)
class ProcessDevices:
    """One worker process as the controller sees it: the roles it hosts, its rank, its node
    (Ray node id; None for the controller's own process) and its last device report."""

    roles: tuple[str, ...]
    rank: int
    node_id: str | None
    report: DeviceReport

    @property
    def role(self) -> str:
        return join_labels(self.roles)


def processes_from_reports(reports: Mapping[tuple[str, int], Any], process_roles: Mapping[str, Iterable[str]],
                           local_node_id: str | None) -> list[ProcessDevices]:
    """Worker processes from their health replies (``WorkerInfo``), keyed by (worker group name,
    rank). ``process_roles`` lists the roles hosted by the processes of each group (several in
    the colocated placement); replies from ``local_node_id`` get node id None (the controller's
    node)."""
    out = []
    for (group, rank), info in sorted(reports.items()):
        report = DeviceReport(tuple(info.gpu_uuids), info.torch_allocated_bytes, info.torch_reserved_bytes)
        node_id = None if info.node_id == local_node_id else info.node_id
        out.append(ProcessDevices(tuple(process_roles.get(group, (group,))), rank, node_id, report))
    return out


def gpu_assignments(processes: Iterable[ProcessDevices]) -> dict[str | None, dict[str, tuple[str, str]]]:
    """``{node id: {GPU UUID: (role label, rank label)}}`` from the processes' reports.

    Every node id of ``processes`` appears, with an empty mapping when none of its processes
    reported a GPU (so that a node's stale labels are cleared)."""
    owners: dict[str | None, dict[str, tuple[set[str], set[int]]]] = {}
    for proc in processes:
        node = owners.setdefault(proc.node_id, {})
        for uuid in proc.report.gpu_uuids:
            roles, ranks = node.setdefault(uuid, (set(), set()))
            roles.update(proc.roles)
            ranks.add(proc.rank)
    return {node_id: {uuid: (join_labels(roles), join_labels(ranks, numeric=True))
                      for uuid, (roles, ranks) in gpus.items()}
            for node_id, gpus in owners.items()}


class TorchMemoryMetrics(Collector):
    """torch's allocated and reserved GPU memory per worker process, as last reported.

    Exported by the controller (the reports reach it through health calls); labels ``role``,
    ``rank``, ``node`` and ``uuid`` (join with ``rrl_gpu_*`` on ``uuid``). Processes on CPU
    report nothing and have no series.
    """

    LABELS = ["role", "rank", "node", "uuid"]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: list[tuple[list[str], int, int]] = []

    def set_processes(self, processes: Iterable[ProcessDevices], node_label: Mapping[str | None, str]) -> None:
        """Replace every series by the reports of ``processes``; ``node_label`` names node ids."""
        rows = []
        for proc in sorted(processes, key=lambda p: (p.role, p.rank)):
            r = proc.report
            if not r.gpu_uuids or r.torch_allocated_bytes is None or r.torch_reserved_bytes is None:
                continue
            node = node_label.get(proc.node_id, proc.node_id or "")
            rows.append(([proc.role, str(proc.rank), node, r.gpu_uuids[0]],
                         r.torch_allocated_bytes, r.torch_reserved_bytes))
        with self._lock:
            self._rows = rows

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        allocated, reserved = self._families()
        with self._lock:
            rows = list(self._rows)
        for labels, alloc, resv in rows:
            allocated.add_metric(labels, alloc)
            reserved.add_metric(labels, resv)
        if rows:
            yield allocated
            yield reserved

    def _families(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily("rrl_torch_memory_allocated_bytes",
                                  "GPU memory held by tensors of a worker process "
                                  "(torch.cuda.memory_allocated), as last reported.",
                                  labels=self.LABELS),
                GaugeMetricFamily("rrl_torch_memory_reserved_bytes",
                                  "GPU memory reserved by torch's caching allocator in a worker "
                                  "process (torch.cuda.memory_reserved), as last reported.",
                                  labels=self.LABELS)]
