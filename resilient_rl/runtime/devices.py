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
that, changing it has no effect. A library that asks CUDA anything during the spare's start-up
imports (``torch.cuda.is_available()`` does, unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) has
initialised it with the variable unset: every GPU of the node visible. Such a spare still takes
the rank: it computes on the rank's devices through their indices in its own enumeration, matched
by UUID (:func:`taken_cuda_indices`), the rank's one made CUDA's current device as it takes them
(its model may be built before any rendezvous selects the device, or without one). It
refuses (:class:`DevicesUnavailable`) when it does not see the rank's devices at all, and when they
are on another node; the controller then tries the next spare, or waits for Ray's restart of the
rank. Which warm-up initialised the driver is logged (:func:`note_driver_initialised`).
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


#: The devices a spare took after CUDA had read ``CUDA_VISIBLE_DEVICES`` in its process: the
#: dead rank's value (``"devices"``) and their CUDA indices here (``"indices"``); see take_devices.
_TAKEN: dict[str, Any] = {}
_NOTED: list[str] = []  # see note_driver_initialised


def visible_devices() -> str | None:
    """The devices this process computes on, as a ``CUDA_VISIBLE_DEVICES`` value: the variable as
    Ray (or the user) set it, or the dead rank's value that a spare took (:func:`take_devices`);
    None when unset."""
    if "devices" in _TAKEN:
        return _TAKEN["devices"]
    value = env.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else value.strip()


def taken_cuda_indices() -> list[int] | None:
    """The CUDA indices, in this process's own enumeration, of the devices it took from a dead
    rank after its driver was initialised (:func:`take_devices`); None otherwise (the rank's
    devices are then what the process sees, from index 0)."""
    return _TAKEN.get("indices")


def taken_device_index(local_rank: int) -> int | None:
    """The CUDA index that rank ``local_rank`` computes on among the devices this process took
    after its driver was initialised (one per local rank); None when it took none that way."""
    taken = taken_cuda_indices()
    return taken[local_rank % len(taken)] if taken else None


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


def take_devices(devices: str | None, node_id: str | None, own_node_id: str, local_rank: int = 0,
                 driver_initialized=cuda_driver_initialized, cuda_indices=None, set_device=None) -> None:
    """Make this process compute on ``devices`` (a dead rank's ``CUDA_VISIBLE_DEVICES`` value) of
    node ``node_id``. Nothing to do when the rank had no GPU (None) or this process already
    computes on exactly those devices. Before CUDA is initialised here, the variable is set to
    ``devices``; after, the process keeps what CUDA sees and computes on the rank's devices by their
    indices among them (``cuda_indices(devices)``, default :func:`cuda_indices_of`), the one of
    ``local_rank`` made CUDA's current device at once (``set_device``, default torch's): a rank
    that builds its model before any rendezvous (a split rollout never joins one) builds it on
    CUDA's current device, which is otherwise device 0, another rank's. Raises
    :class:`DevicesUnavailable`, changing nothing, when the devices are on another node than this
    process (``own_node_id``) or CUDA is initialised here without them."""
    if devices is None or visible_devices() == devices:
        return
    if node_id is not None and node_id != own_node_id:
        raise DevicesUnavailable(f"the rank's GPUs (CUDA_VISIBLE_DEVICES={devices}) are on node {node_id}, "
                                 f"this process runs on node {own_node_id}")
    if not driver_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        logger.info("this process computes on CUDA_VISIBLE_DEVICES=%s from now on", devices)
        return
    indices = (cuda_indices or cuda_indices_of)(devices)
    if not indices:
        raise DevicesUnavailable(f"CUDA is already initialised in this process on CUDA_VISIBLE_DEVICES="
                                 f"{env.get('CUDA_VISIBLE_DEVICES')}, which does not show it {devices}")
    _TAKEN.update(devices=devices, indices=list(indices))
    if set_device is None:
        import torch

        set_device = torch.cuda.set_device
    set_device(taken_device_index(local_rank))
    logger.info("this process computes on CUDA_VISIBLE_DEVICES=%s from now on: CUDA devices %s of its own, "
                "its driver having been initialised before", devices, indices)


def cuda_indices_of(devices: str, nvml: Any | None = None) -> list[int] | None:
    """The indices, among this process's CUDA devices, of the node's devices that ``devices`` (a
    ``CUDA_VISIBLE_DEVICES`` value as Ray sets it: integers are NVML's indices, or UUIDs) names,
    matched by UUID; None where this process does not see them all, or NVML cannot tell. For a
    process whose CUDA driver is initialised already (torch's own CUDA state is then set up too)."""
    import torch

    try:
        torch.cuda.init()
    except (AssertionError, RuntimeError) as exc:  # a torch without CUDA, or no device after all
        logger.debug("CUDA cannot list this process's devices: %s", exc)
        return None
    mine = _nvml_lookup.cuda_device_uuids() or []
    every = _nvml_uuids(nvml)
    wanted = [every[i] for i in resolve_visible_devices([e.strip() for e in devices.split(",") if e.strip()], every)]
    if not wanted or any(uuid not in mine for uuid in wanted):
        return None
    return [mine.index(uuid) for uuid in wanted]


def note_driver_initialised(what: str, before: bool) -> None:
    """Log (once per process) that ``what`` initialised the CUDA driver, which was not (``before``)
    when it began, in a process not yet given devices (a warm spare: a rank's start-up work runs
    beside its rendezvous, which initialises CUDA on the rank's GPUs). Such a spare then computes on
    a dead rank's GPUs through its own enumeration (:func:`take_devices`), and the log says which
    start-up work fixed that enumeration."""
    if before or _NOTED or visible_devices() is not None or not cuda_driver_initialized():
        return
    _NOTED.append(what)
    logger.info("%s initialised the CUDA driver in this process (CUDA_VISIBLE_DEVICES=%s)", what,
                env.get("CUDA_VISIBLE_DEVICES"))


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
        every = _nvml_uuids(nvml)
        uuids = tuple(every[i] for i in resolve_visible_devices(entries, every, cuda_uuids)) if every else ()
        if nvml is None:  # a test double may change between calls; the real driver does not
            _VISIBLE_CACHE[key] = uuids
        return uuids


def _nvml_uuids(nvml: Any | None = None) -> list[str]:
    """The node's GPU UUIDs by NVML index; empty without NVML, a driver or a GPU.
    ``nvml``: a ``pynvml``-like module (a test double); None imports ``pynvml``."""
    module = nvml if nvml is not None else _load_pynvml()
    if module is None:
        return []
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        logger.debug("NVML is unavailable (%s): this process reports no GPU", exc)
        return []
    try:
        return [_as_str(module.nvmlDeviceGetUUID(module.nvmlDeviceGetHandleByIndex(i)))
                for i in range(module.nvmlDeviceGetCount())]
    except module.NVMLError as exc:
        logger.warning("NVML cannot list the GPUs (%s): this process reports no GPU", exc)
        return []
    finally:
        try:
            module.nvmlShutdown()
        except module.NVMLError:
            pass


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


#: Ray's switch for leaving a process's ``CUDA_VISIBLE_DEVICES`` alone (on when ``1`` or ``true``).
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def ray_gpu_ids() -> list[str]:
    """The GPUs Ray gave this process (its ids, as Ray would write them into the variable)."""
    import ray

    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def see_ray_gpus_only(gpu_ids=ray_gpu_ids, driver_initialized=cuda_driver_initialized) -> None:
    """Called first in a rank's process: on a cluster started with Ray's switch for leaving
    ``CUDA_VISIBLE_DEVICES`` alone (:data:`NOSET_VISIBLE_DEVICES`; OpenRLHF's scripts start
    theirs so), set the variable to the GPUs Ray gave the process, as Ray does without the
    switch. The process would otherwise see every GPU of its node and compute on the one of its
    local rank, the same GPU for ranks of two groups on one node, and a warm spare, which takes a
    dead rank's GPUs by this value, could not. Nothing to do without the switch, for a process
    given no GPU (a spare, a CPU rank), or once CUDA has read the variable (then it is logged).
    The switch is not turned off through the actors' ``runtime_env`` instead: a per-actor
    ``runtime_env`` starts each process through Ray's setup-worker, seconds more per restart."""
    if env.get(NOSET_VISIBLE_DEVICES, "").strip().lower() not in ("1", "true"):
        return
    ids = gpu_ids()
    value = ",".join(ids)
    if not ids or visible_devices() == value:
        return
    if driver_initialized():
        logger.warning("%s is set and CUDA already started in this process: it computes on the GPUs "
                       "CUDA_VISIBLE_DEVICES=%s shows, not only on those Ray gave it (%s)", NOSET_VISIBLE_DEVICES,
                       visible_devices(), value)
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = value
