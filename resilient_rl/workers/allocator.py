"""The caching allocator's own account of an update pass on a GPU: its peaks and its retries.

The memory plan (:mod:`resilient_rl.workers.memory_plan`) predicts the peak of an update pass;
the caching allocator measures it. A pass planned close to the device's memory can make the
allocator free its cache and retry a ``cudaMalloc`` (``num_alloc_retries``), each retry a
device-wide synchronisation: a pass that fits and crawls. On a GPU both are step metrics of the
trained roles, beside the plan's prediction, so that a run shows whether the plan holds and
whether the allocator thrashes: ``perf/<role>_peak_bytes`` (allocated), ``perf/<role>_reserved_peak_bytes``,
``perf/<role>_alloc_retries`` (during the pass) and ``perf/<role>_planned_peak_bytes`` (where
``micro_batch_tokens=auto`` planned it). Nothing is reported on a CPU.
"""

from __future__ import annotations

import torch


class AllocatorWindow:
    """The allocator's counters over one update pass on ``device`` (from construction to
    :meth:`metrics`); nothing on a device other than CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self._retries = 0
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def metrics(self, prefix: str, planned_peak: int | None = None) -> dict[str, float]:
        if self.device is None:
            return {}
        stats = torch.cuda.memory_stats(self.device)
        out = {f"perf/{prefix}_peak_bytes": float(stats.get("allocated_bytes.all.peak", 0)),
               f"perf/{prefix}_reserved_peak_bytes": float(stats.get("reserved_bytes.all.peak", 0)),
               f"perf/{prefix}_alloc_retries": float(stats.get("num_alloc_retries", 0) - self._retries)}
        if planned_peak is not None:
            out[f"perf/{prefix}_planned_peak_bytes"] = float(planned_peak)
        return out
