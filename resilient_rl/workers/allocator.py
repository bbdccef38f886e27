"""The caching allocator's own account of an update pass on a GPU: its peaks and its retries.

The memory plan (:mod:`resilient_rl.workers.memory_plan`) predicts the peak of an update pass;
the caching allocator measures it. A pass planned close to the device's memory can make the
allocator free its cache and retry a ``cudaMalloc`` (``num_alloc_retries``), each retry a
device-wide synchronisation: a pass that fits and crawls. On a GPU both are step metrics of the
trained roles, beside the plan's prediction, so that a run shows whether the plan holds and
whether the allocator thrashes: ``perf/<role>_peak_bytes`` (allocated), ``perf/<role>_reserved_peak_bytes``,
``perf/<role>_alloc_retries`` (during the pass) and ``perf/<role>_planned_peak_bytes`` (where
``micro_batch_tokens=auto`` planned it). Nothing is reported on a CPU.

A GPU worker also lets the allocator grow its segments in place (:func:`grow_segments_in_place`).
The caching allocator keeps every block it has reserved, in the sizes it was first asked for. A
step asks for changing sizes: the rollout's cache and its batches, then packed micro-batches whose
token counts differ from one to the next. Blocks of one pass's sizes then sit unused beside the
next pass's new ones: the H200's 0.5 B run reserved 137.4 GiB of the device's 139 GiB for a peak
of 98.6 GiB allocated, and on a smaller device such a gap ends in cudaMalloc retries or an out of
memory error the memory plan did not predict. With ``expandable_segments`` the allocator maps
physical memory into one growing range of addresses per stream, so a freed range serves any later
size; torch documents it for allocation sizes that change often, and TorchTitan and verl train
with it.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from resilient_rl import env

logger = logging.getLogger(__name__)

#: What a GPU worker sets unless the environment configures it (:func:`grow_segments_in_place`).
EXPANDABLE_SEGMENTS = "expandable_segments:True"

#: Set once this process has set :data:`EXPANDABLE_SEGMENTS` (or chose not to): what it decided.
_DECIDED: list[bool] = []


def grow_segments_in_place(setter: Callable[[str], None] | None = None) -> bool:
    """Make this process's CUDA caching allocator grow its segments in place (see the module's
    docs), once per process, unless the environment's allocator settings (:func:`resilient_rl.env.alloc_conf`)
    name ``expandable_segments`` themselves (the user's choice stands, ``expandable_segments:False``
    turns it off) or another allocator backend. Takes effect for the segments reserved from then on.
    ``setter`` (default: torch's) applies a setting; one that fails is logged, and the allocator
    keeps its settings. Returns whether the allocator grows its segments in place."""
    if _DECIDED:
        return _DECIDED[0]
    given = env.alloc_conf()
    settings = dict(_parse(given[1])) if given else {}
    if "expandable_segments" in settings or settings.get("backend", "native") != "native":
        _DECIDED.append(settings.get("expandable_segments", "").lower() == "true")
        logger.info("the CUDA caching allocator keeps the environment's settings (%s=%s)", *given)
        return _DECIDED[0]
    try:
        (setter or _torch_setter())(EXPANDABLE_SEGMENTS)
    except (RuntimeError, ValueError, AttributeError) as exc:
        _DECIDED.append(False)
        logger.warning("the CUDA caching allocator could not be set to grow its segments in place (%s: %s)",
                       type(exc).__name__, exc)
        return False
    _DECIDED.append(True)
    logger.info("the CUDA caching allocator grows its segments in place (%s; PYTORCH_ALLOC_CONF="
                "expandable_segments:False turns it off)", EXPANDABLE_SEGMENTS)
    return True


def _parse(conf: str) -> list[tuple[str, str]]:
    """``key:value`` pairs of an allocator settings string (``a:1,b:2``), keys stripped."""
    pairs = (item.split(":", 1) for item in conf.split(",") if item.strip())
    return [(p[0].strip(), p[1].strip() if len(p) > 1 else "") for p in pairs]


def _torch_setter() -> Callable[[str], None]:
    """torch's call that changes the allocator's settings at run time (newer torch names it
    ``torch._C._accelerator_setAllocatorSettings`` and deprecates the older name)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter if setter is not None else torch.cuda.memory._set_allocator_settings


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
