"""A fake NVML module: stands in for ``pynvml`` on machines without an NVIDIA driver.

It implements the subset of the ``pynvml`` API that :mod:`resilient_rl.telemetry.device` calls,
with the same names, constants and error classes (an ``NVMLError`` carrying ``value`` and a
``NVMLError_NotSupported`` subclass), so the GPU sampler runs unchanged against it::

    nvml = FakeNVML([FakeGpu(uuid="GPU-aaaa", utilization_percent=75), FakeGpu(uuid="GPU-bbbb")])
    sampler = GpuSampler(nvml=nvml)

Readings are plain attributes of :class:`FakeGpu` and may be changed between samples. A reading
listed in ``FakeGpu.unsupported`` raises ``NVMLError_NotSupported`` like a board without that
sensor; ``FakeNVML(init_error=...)`` makes ``nvmlInit`` fail like a machine without a driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1

FIELDS = frozenset({"utilization", "memory", "power", "temperature", "sm_clock"})


class NVMLError(Exception):
    """Base NVML error; ``value`` is the NVML return code, as in ``pynvml``."""

    def __init__(self, value: int, message: str = "") -> None:
        super().__init__(message or f"NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED, "Not Supported")


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found")


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_GPU_IS_LOST, "GPU is lost")


class Utilization(NamedTuple):
    """``nvmlDeviceGetUtilizationRates`` result: percentages."""

    gpu: int
    memory: int


class MemoryInfo(NamedTuple):
    """``nvmlDeviceGetMemoryInfo`` result: bytes."""

    total: int
    free: int
    used: int


@dataclass
class FakeGpu:
    """One fake device and its current readings, in NVML's units."""

    uuid: str
    utilization_percent: int = 50
    memory_used_bytes: int = 10 * 2**30
    memory_total_bytes: int = 80 * 2**30
    power_milliwatts: int = 300_000
    temperature_celsius: int = 60
    sm_clock_mhz: int = 1410
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.unsupported) - FIELDS
        if unknown:
            raise ValueError(f"FakeGpu.unsupported: unknown readings {sorted(unknown)}; "
                             f"known: {sorted(FIELDS)}")


@dataclass(frozen=True)
class _Handle:
    index: int


class FakeNVML:
    """Module-like fake of ``pynvml`` over a list of :class:`FakeGpu` (NVML index order)."""

    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost

    def __init__(self, gpus: list[FakeGpu] | None = None, *,
                 init_error: type[NVMLError] | None = None) -> None:
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.initialized = False
        self.init_calls = 0
        self.shutdown_calls = 0

    # -- library lifecycle ---------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error()
        self.initialized = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._check_init()
        self.shutdown_calls += 1
        self.initialized = False

    # -- enumeration ---------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2, f"Invalid Argument: no device {index}")
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:  # noqa: N802
        return self._gpu(handle).uuid

    # -- readings ------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Utilization:  # noqa: N802
        gpu = self._gpu(handle, "utilization")
        return Utilization(gpu=gpu.utilization_percent, memory=gpu.utilization_percent)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> MemoryInfo:  # noqa: N802
        gpu = self._gpu(handle, "memory")
        return MemoryInfo(total=gpu.memory_total_bytes,
                          free=gpu.memory_total_bytes - gpu.memory_used_bytes,
                          used=gpu.memory_used_bytes)

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:  # noqa: N802
        return self._gpu(handle, "power").power_milliwatts

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:  # noqa: N802
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(2, f"Invalid Argument: sensor {sensor}")
        return self._gpu(handle, "temperature").temperature_celsius

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:  # noqa: N802
        if clock_type != NVML_CLOCK_SM:
            raise NVMLError(2, f"Invalid Argument: clock type {clock_type}")
        return self._gpu(handle, "sm_clock").sm_clock_mhz

    # -- helpers -------------------------------------------------------------------------
    def _check_init(self) -> None:
        if not self.initialized:
            raise NVMLError(1, "Uninitialized")

    def _gpu(self, handle: _Handle, reading: str | None = None) -> FakeGpu:
        self._check_init()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        if reading is not None and reading in gpu.unsupported:
            raise NVMLError_NotSupported()
        return gpu
