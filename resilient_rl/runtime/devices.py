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

from resilient_rl import env

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
