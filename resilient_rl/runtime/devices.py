"""The GPUs a worker process computes on, and a warm spare taking a dead rank's GPUs.

Ray gives each rank's process its GPUs by setting ``CUDA_VISIBLE_DEVICES`` when it starts the
actor (entries name devices of the node: indices of the node's own list, or UUIDs), and the
process computes on what that variable shows it. A rank's *devices* are that value as its process
reported it, with the node it runs on (:func:`visible_devices`, in every ping reply).

A warm spare of a GPU group reserves no GPU of its own: on a cluster where every GPU runs a rank
(the usual case), a spare that asked for one would never start. It waits on a node of its group
without touching CUDA, and when a rank of that node dies it takes the rank's devices
(:func:`take_devices`): it sets ``CUDA_VISIBLE_DEVICES`` to the dead rank's value before CUDA is
initialised in the process, so it then sees exactly what the rank saw, and its models, process
group and telemetry run unchanged. The dead process's memory on those GPUs is released by the
driver when the process exits. Ray does not reset the variable between an actor's calls.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when the driver is initialised in the process; after
that, changing it has no effect and a spare would compute on the wrong device. So a spare refuses
(:class:`DevicesUnavailable`) when its driver is already initialised on other devices, and when
the rank's devices are on another node; the controller then tries the next spare, or waits for
Ray's restart of the rank.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from resilient_rl import env
from resilient_rl import nvml as _nvml_lookup
from resilient_rl.nvml import as_str as _as_str, load_pynvml as _load_pynvml, resolve_visible_devices

logger = logging.getLogger(__name__)

#: ``CUDA_ERROR_NOT_INITIALIZED``: what the driver API answers before ``cuInit`` in this process.
_CUDA_ERROR_NOT_INITIALIZED = 3
_LIBCUDA = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


class DevicesUnavailable(RuntimeError):
    """This process cannot compute on the devices it was asked to take."""


def visible_devices() -> str | None:
    """This process's ``CUDA_VISIBLE_DEVICES`` as Ray (or the user) set it; None when unset."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else value.strip()


def cuda_driver_initialized() -> bool:
    """Whether the CUDA driver has been initialised in this process (``cuInit`` ran: CUDA has read
    ``CUDA_VISIBLE_DEVICES`` for good). Asked of the driver itself, which answers
    ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit`` without initialising anything; False on a
    machine without a driver."""
    for name in _LIBCUDA:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return lib.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED
    return False


def take_devices(devices: str | None, node_id: str | None, own_node_id: str,
                 driver_initialized=cuda_driver_initialized) -> None:
    """Make this process compute on ``devices`` (a dead rank's ``CUDA_VISIBLE_DEVICES`` value) of
    node ``node_id``. Nothing to do when the rank had no GPU (None) or this process already sees
    exactly those devices. Raises :class:`DevicesUnavailable` when the devices are on another node
    than this process (``own_node_id``) or when CUDA is already initialised here on other devices."""
    if devices is None or visible_devices() == devices:
        return
    if node_id is not None and node_id != own_node_id:
        raise DevicesUnavailable(f"the rank's GPUs (CUDA_VISIBLE_DEVICES={devices}) are on node {node_id}, "
                                 f"this process runs on node {own_node_id}")
    if driver_initialized():
        raise DevicesUnavailable(f"CUDA is already initialised in this process on CUDA_VISIBLE_DEVICES="
                                 f"{visible_devices()}; it cannot compute on {devices} instead")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    logger.info("this process computes on CUDA_VISIBLE_DEVICES=%s from now on", devices)


# ---------------------------------------------------------------------------- device identity
# What a worker says about its GPU in every ping (see resilient_rl.telemetry.gpu_owners).

_VISIBLE_LOCK = threading.Lock()
_VISIBLE_CACHE: dict[tuple[Any, ...], tuple[str, ...]] = {}


def visible_gpu_uuids(nvml: Any | None = None) -> tuple[str, ...]:
    """UUIDs of this process's CUDA devices in CUDA order (entry ``i`` is ``cuda:i``).

    Read once per NVML module, ``CUDA_VISIBLE_DEVICES`` value and CUDA's own device UUIDs
    (none change under a running process, except that CUDA tells its UUIDs only once it is
    initialised), without initialising CUDA. Empty without NVML, a driver or a GPU.
    ``nvml``: a ``pynvml``-like module (a test double); None imports ``pynvml``.
    """
    entries = env.cuda_visible_devices()
    cuda_uuids = _nvml_lookup.cuda_device_uuids()
    key = (id(nvml), None if entries is None else tuple(entries),
           None if cuda_uuids is None else tuple(cuda_uuids))
    with _VISIBLE_LOCK:
        if key in _VISIBLE_CACHE:
            return _VISIBLE_CACHE[key]
        module = nvml if nvml is not None else _load_pynvml()
        uuids: tuple[str, ...] = ()
        if module is not None:
            try:
                module.nvmlInit()
            except module.NVMLError as exc:
                logger.debug("NVML is unavailable (%s): this process reports no GPU", exc)
            else:
                try:
                    every = [_as_str(module.nvmlDeviceGetUUID(module.nvmlDeviceGetHandleByIndex(i)))
                             for i in range(module.nvmlDeviceGetCount())]
                    uuids = tuple(every[i] for i in resolve_visible_devices(entries, every, cuda_uuids))
                except module.NVMLError as exc:
                    logger.warning("NVML cannot list the GPUs (%s): this process reports no GPU", exc)
                finally:
                    try:
                        module.nvmlShutdown()
                    except module.NVMLError:
                        pass
        if nvml is None:  # a test double may change between calls; the real driver does not
            _VISIBLE_CACHE[key] = uuids
        return uuids


@dataclass(frozen=True)
class DeviceReport:
    """What a worker process says about its GPU: the UUIDs it computes on, and torch's caching
    allocator counters on that device (None on CPU or before CUDA is initialised)."""

    gpu_uuids: tuple[str, ...] = ()
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None


def device_report(cuda_index: int | None, nvml: Any | None = None) -> DeviceReport:
    """The report of a process computing on CUDA device ``cuda_index`` (None: on CPU).

    Cheap enough for every health call: NVML is read once per process (see
    :func:`visible_gpu_uuids`) and torch's counters are host-side. Never initialises CUDA.
    """
    if cuda_index is None:
        return DeviceReport()
    uuids = visible_gpu_uuids(nvml)
    if not 0 <= cuda_index < len(uuids):
        return DeviceReport()
    allocated = reserved = None
    import torch

    # Reading the counters before CUDA is initialised would report zeros for memory in use by
    # nobody yet; after, they are host-side reads of the caching allocator (no synchronisation).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        allocated = int(torch.cuda.memory_allocated(cuda_index))
        reserved = int(torch.cuda.memory_reserved(cuda_index))
    return DeviceReport((uuids[cuda_index],), allocated, reserved)
