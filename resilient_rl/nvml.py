"""NVML access shared by the worker side (which GPU a process computes on) and the device
sampler: loading ``pynvml`` when present, and mapping ``CUDA_VISIBLE_DEVICES`` to NVML devices.
A bottom-layer module: it imports nothing of the project."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)


def driver_present() -> bool:
    """Whether this machine has an NVIDIA driver (its device nodes), so that NVML should load."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def load_pynvml() -> ModuleType | None:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def as_str(value: Any) -> str:
    # Older nvidia-ml-py releases return bytes for strings, newer ones str.
    return value.decode() if isinstance(value, bytes) else str(value)


def resolve_visible_devices(entries: list[str] | None, uuids: list[str]) -> list[int]:
    """Map ``CUDA_VISIBLE_DEVICES`` entries to NVML indices, in CUDA order.

    ``uuids`` lists the UUID of each NVML device by NVML index. ``entries`` None means every
    device is visible. Like the CUDA runtime, enumeration stops at the first entry that names no
    device (an out-of-range index, an unknown or ambiguous UUID prefix, ``-1``), and a device
    named twice is counted once.
    """
    if entries is None:
        return list(range(len(uuids)))
    visible: list[int] = []
    for entry in entries:
        nvml_index = _match_entry(entry, uuids)
        if nvml_index is None:
            logger.debug("CUDA_VISIBLE_DEVICES entry %r names no device; later entries ignored", entry)
            break
        if nvml_index not in visible:
            visible.append(nvml_index)
    return visible


def _match_entry(entry: str, uuids: list[str]) -> int | None:
    if entry.isdigit():
        index = int(entry)
        return index if index < len(uuids) else None
    wanted = entry if entry.startswith("GPU-") else f"GPU-{entry}"
    matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(wanted)]
    return matches[0] if len(matches) == 1 else None
