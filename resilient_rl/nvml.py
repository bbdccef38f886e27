"""NVML access shared by the worker side (which GPU a process computes on) and the device
sampler: loading ``pynvml`` when present, and mapping CUDA's devices to NVML devices.
A bottom-layer module: it imports nothing of the project.

NVML numbers devices in PCI bus order; CUDA numbers them fastest first unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and an integer in ``CUDA_VISIBLE_DEVICES`` indexes CUDA's order.
The two agree only on a machine of identical GPUs (CUDA breaks ties by PCI bus), so devices are
matched by UUID wherever CUDA can tell them (:func:`cuda_device_uuids`), and by the variable's
entries read in NVML's order only before CUDA is initialised in the process.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
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


def nvml_uuid(value: Any) -> str:
    """A UUID as NVML spells it: torch prints a CUDA UUID without NVML's ``GPU-`` prefix."""
    text = as_str(value).strip()
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def cuda_device_uuids() -> list[str] | None:
    """UUIDs of this process's CUDA devices in CUDA order (entry ``i`` is ``cuda:i``), as NVML
    spells them.

    None where CUDA is not initialised in this process: reading device properties would
    initialise it and fix ``CUDA_VISIBLE_DEVICES`` for good, which a warm spare that may still
    take another rank's devices must not do. None too where torch reports no UUID (older
    builds). torch is not imported here: a process that never imported it has no CUDA context.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return [nvml_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except (AttributeError, RuntimeError, AssertionError) as exc:
        logger.debug("CUDA cannot tell its devices' UUIDs (%s); matching by CUDA_VISIBLE_DEVICES", exc)
        return None


def resolve_visible_devices(entries: list[str] | None, uuids: list[str],
                            cuda_uuids: list[str] | None = None) -> list[int]:
    """Map this process's CUDA devices to NVML indices, in CUDA order.

    ``uuids`` lists the UUID of each NVML device by NVML index. ``cuda_uuids``, when known (see
    :func:`cuda_device_uuids`), lists the UUID of each CUDA device: the answer is then exact
    whatever CUDA's device order. Otherwise ``entries`` (``CUDA_VISIBLE_DEVICES``; None means
    every device is visible) is read with integers as NVML indices, which is CUDA's order only
    on a machine of identical GPUs or with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. Like the CUDA
    runtime, enumeration stops at the first entry that names no device (an out-of-range index,
    an unknown or ambiguous UUID prefix, ``-1``), and a device named twice is counted once.
    """
    if cuda_uuids is not None:
        by_uuid = [uuids.index(uuid) if uuid in uuids else None for uuid in cuda_uuids]
        if None not in by_uuid:
            return [int(i) for i in by_uuid if i is not None]
        logger.debug("CUDA devices %s are not all known to NVML; matching by CUDA_VISIBLE_DEVICES",
                     cuda_uuids)
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
