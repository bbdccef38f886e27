"""Device samplers: per-GPU readings through NVML and per-process CPU and memory through psutil.

:class:`GpuSampler` reads each visible GPU with NVML (package ``nvidia-ml-py``, module ``pynvml``).
NVML enumerates every device of the machine whatever ``CUDA_VISIBLE_DEVICES`` says, and in PCI
order where CUDA's may differ, so devices are matched to CUDA indices by UUID: CUDA's own UUID of
each device once CUDA is initialised in the process, and before that entry ``i`` of
``CUDA_VISIBLE_DEVICES`` (an index, a full UUID or a unique ``GPU-`` UUID prefix) as device ``i``
(see :mod:`resilient_rl.nvml`). Without NVML (no driver, no
library, no GPU) the sampler is disabled and :meth:`GpuSampler.sample` returns an empty list, so
no GPU series is ever exported as zero. A reading a device does not support is ``None``.

:class:`ProcessSampler` reads CPU seconds and resident memory of worker processes by pid; it is
what a CPU-only machine exports instead of GPU readings.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import psutil

from resilient_rl import env
from resilient_rl import nvml as _nvml_lookup
from resilient_rl.nvml import as_str as _as_str, driver_present as _driver_present
from resilient_rl.nvml import load_pynvml as _load_pynvml, resolve_visible_devices

logger = logging.getLogger(__name__)


# NVML reports power in milliwatts and clocks in MHz; Prometheus wants base units.
_MILLIWATT = 1e-3
_MHZ = 1e6


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU. ``index`` is the CUDA index; fields NVML cannot read are None."""

    index: int
    uuid: str
    utilization_ratio: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_watts: float | None
    temperature_celsius: float | None
    sm_clock_hertz: float | None


@dataclass(frozen=True)
class ProcessSample:
    """One reading of one worker process."""

    role: str
    rank: int
    pid: int
    cpu_seconds: float
    resident_memory_bytes: int


class GpuSampler:
    """Reads utilization, memory, power, temperature and SM clock of the visible GPUs.

    Args:
        nvml: an NVML module (``pynvml`` or a test double); None imports ``pynvml``.
        all_devices: sample every device of the machine and ignore ``CUDA_VISIBLE_DEVICES``
            (for a per-node sampler running in a process that was given no GPU). Indices are
            then NVML indices.
        max_age_s: reuse a reading for this long (``telemetry.gpu_sample_interval_s``), so that
            frequent scrapes, or several scrapers, do not query the driver every time; 0 reads
            on every call.
    """

    def __init__(self, nvml: Any | None = None, *, all_devices: bool = False,
                 max_age_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml if nvml is not None else _load_pynvml()
        self._all_devices = all_devices
        self._max_age_s = max(0.0, float(max_age_s))
        self._clock = clock
        self._cached: tuple[float, list[GpuSample]] | None = None
        self._lock = threading.Lock()
        self._handles: list[tuple[int, str, Any]] = []  # (cuda index, uuid, handle)
        # Whether the CUDA indices came from CUDA's own UUIDs (exact) or from the variable's
        # entries (a guess on mixed GPUs): a guess is redone once CUDA is initialised.
        self._matched_by_uuid = all_devices
        self._warned: set[tuple[str, str]] = set()
        self.available = False
        if self._nvml is None:
            logger.info("pynvml is not installed; GPU metrics are disabled")
            return
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            # A machine without a GPU driver is the expected case on CPU: say it in train.log only.
            level = logging.INFO if _driver_present() else logging.DEBUG
            logger.log(level, "NVML is unavailable (%s); GPU metrics are disabled", exc)
            return
        self.available = True
        try:
            self._discover()
        except self._nvml.NVMLError as exc:
            logger.warning("NVML device discovery failed (%s); GPU metrics are disabled", exc)
            self.close()

    def _discover(self) -> None:
        nvml = self._nvml
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_as_str(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        # With all_devices the CUDA index is the NVML index, as it is when the variable is unset.
        entries = None if self._all_devices else env.cuda_visible_devices()
        cuda_uuids = None if self._all_devices else _nvml_lookup.cuda_device_uuids()
        self._matched_by_uuid = self._all_devices or cuda_uuids is not None
        self._handles = [
            (cuda_index, uuids[nvml_index], handles[nvml_index])
            for cuda_index, nvml_index in enumerate(resolve_visible_devices(entries, uuids, cuda_uuids))
        ]

    def _rediscover(self) -> None:
        # CUDA was initialised after this sampler started: its UUIDs now give the exact mapping.
        try:
            self._discover()
        except self._nvml.NVMLError as exc:
            logger.warning("NVML device discovery failed (%s); keeping the earlier device mapping", exc)
            self._matched_by_uuid = True  # do not retry on every sample
        self._cached = None

    @property
    def devices(self) -> list[tuple[int, str]]:
        """The sampled devices as (CUDA index, UUID) pairs."""
        return [(index, uuid) for index, uuid, _ in self._handles]

    def sample(self) -> list[GpuSample]:
        """Read every visible device (or reuse a reading younger than ``max_age_s``); an empty
        list when NVML is unavailable."""
        if not self.available:
            return []
        nvml = self._nvml
        samples = []
        with self._lock:
            now = self._clock()
            if not self._matched_by_uuid and _nvml_lookup.cuda_device_uuids() is not None:
                self._rediscover()
            if self._cached is not None and now - self._cached[0] < self._max_age_s:
                return list(self._cached[1])
            for index, uuid, handle in self._handles:
                util = self._read(uuid, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
                memory = self._read(uuid, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
                power = self._read(uuid, "power", nvml.nvmlDeviceGetPowerUsage, handle)
                temp = self._read(uuid, "temperature", nvml.nvmlDeviceGetTemperature, handle,
                                  nvml.NVML_TEMPERATURE_GPU)
                clock = self._read(uuid, "sm_clock", nvml.nvmlDeviceGetClockInfo, handle,
                                   nvml.NVML_CLOCK_SM)
                samples.append(GpuSample(
                    index=index,
                    uuid=uuid,
                    utilization_ratio=None if util is None else float(util.gpu) / 100.0,
                    memory_used_bytes=None if memory is None else int(memory.used),
                    memory_total_bytes=None if memory is None else int(memory.total),
                    power_watts=None if power is None else float(power) * _MILLIWATT,
                    temperature_celsius=None if temp is None else float(temp),
                    sm_clock_hertz=None if clock is None else float(clock) * _MHZ,
                ))
            self._cached = (now, samples)
        return list(samples)

    def _read(self, uuid: str, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            # Not-supported readings are normal (e.g. power on some boards); anything else is
            # worth one warning per device and field, not one per scrape.
            not_supported = getattr(exc, "value", None) == self._nvml.NVML_ERROR_NOT_SUPPORTED
            if not not_supported and (uuid, field) not in self._warned:
                self._warned.add((uuid, field))
                logger.warning("NVML cannot read %s of GPU %s: %s", field, uuid, exc)
            return None

    def close(self) -> None:
        """Release NVML; later samples are empty."""
        with self._lock:
            if self.available:
                self.available = False
                self._handles = []
                self._cached = None
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError as exc:
                    logger.debug("nvmlShutdown failed: %s", exc)


class ProcessSampler:
    """Reads CPU seconds (user + system) and resident memory of worker processes.

    Args:
        pids: the pid of each worker, keyed by (role, rank). Processes that have exited are
            left out of samples rather than reported as zero.
    """

    def __init__(self, pids: Mapping[tuple[str, int], int] | None = None) -> None:
        self._lock = threading.Lock()
        self._pids: dict[tuple[str, int], int] = {}
        self._procs: dict[tuple[str, int], psutil.Process] = {}
        # Workers whose process exited. Their pid is never reopened: the number may already
        # belong to an unrelated process.
        self._gone: set[tuple[str, int]] = set()
        self.set_pids(pids or {})

    def set_pids(self, pids: Mapping[tuple[str, int], int]) -> None:
        """Replace the set of watched processes (e.g. after a worker restarted with a new pid)."""
        with self._lock:
            new_pids = {(str(role), int(rank)): int(pid) for (role, rank), pid in pids.items()}
            kept = {key for key, pid in new_pids.items() if self._pids.get(key) == pid}
            self._procs = {key: proc for key, proc in self._procs.items() if key in kept}
            self._gone &= kept
            self._pids = new_pids

    def sample(self) -> list[ProcessSample]:
        """Read every watched process that is still running."""
        samples = []
        with self._lock:
            for key, pid in self._pids.items():
                if key in self._gone:
                    continue
                try:
                    proc = self._procs.get(key)
                    if proc is None:
                        proc = self._procs[key] = psutil.Process(pid)
                    elif not proc.is_running():  # exited, or its pid was reused
                        raise psutil.NoSuchProcess(pid)
                    with proc.oneshot():
                        times = proc.cpu_times()
                        rss = proc.memory_info().rss
                except psutil.NoSuchProcess:  # includes ZombieProcess
                    self._gone.add(key)
                    self._procs.pop(key, None)
                    continue
                except psutil.AccessDenied:
                    continue
                samples.append(ProcessSample(role=key[0], rank=key[1], pid=pid,
                                             cpu_seconds=float(times.user + times.system),
                                             resident_memory_bytes=int(rss)))
        return samples
