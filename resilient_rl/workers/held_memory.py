"""A model build or restore on a GPU that another process still holds: wait for its memory, then again.

When a rank's process dies, the driver releases its device memory only as the process's files
close, which for a context of tens of GiB is not instant; the controller hears of the death as
soon as the process's sockets close, and a warm spare takes the rank's GPU at once
(:mod:`resilient_rl.runtime.devices`). The spare's first model build, or the restore of the rank's
state after it (the optimizer's state is made then), can find the GPU still full of the dead
process's memory, and torch raises ``OutOfMemoryError``: for any other pass that means the run's
settings ask too much (:mod:`resilient_rl.workers.out_of_memory`), and the run stops.

:func:`retry_while_held` tells the two apart by the device's memory held outside this process:
the device's total less its free memory and less what this process's caching allocator reserved
(:class:`DeviceMemory`). A call that runs out while at least :data:`OUTSIDE_FLOOR` is held
outside undoes what it left (a restore's half-made optimizer state: :func:`forget_optimizer_state`),
waits until some of that memory comes free and settles (a process let go of it), and runs again,
all within ``recovery.restart_timeout_s`` (how long a recovery waits for a dead rank's new
process). Memory held outside that never comes free (another job on the GPU) ends the wait at
that deadline; the error then says how much was held outside
(:func:`resilient_rl.workers.out_of_memory.device_memory_error`). A call that runs out with the
device's memory its own is not retried: it needs the same memory again. The model builds
(:func:`builds_when_memory_frees`) and the loads of a rank's whole state from a snapshot or a
checkpoint (:meth:`~resilient_rl.workers.checkpointing.RankCheckpointer.while_held`) wait this way.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from resilient_rl.runtime import progress

__all__ = ["DeviceMemory", "OUTSIDE_FLOOR", "builds_when_memory_frees", "device_memory", "forget_optimizer_state",
           "retry_while_held"]

T = TypeVar("T")

log = logging.getLogger(__name__)

GIB = 2**30

#: Memory held outside the caching allocator that is this process's own or no other process's:
#: the CUDA context, the libraries' workspaces, NCCL's buffers (together well under this).
OUTSIDE_FLOOR = 2 * GIB

#: A drop in the memory held outside of at least this much is a process letting go of it.
CAME_FREE = GIB

#: The memory held outside has settled once two readings this far apart differ by less than this.
SETTLED = 256 * 2**20

#: Seconds between two readings of the device's memory while waiting.
POLL_S = 0.2


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory: ``free`` and ``total`` as the driver counts them,
    ``reserved`` by this process's caching allocator."""

    free: int
    total: int
    reserved: int

    @property
    def outside(self) -> int:
        """Bytes in use that this process's allocator does not hold: other processes' memory, and
        this process's CUDA context and libraries."""
        return max(0, self.total - self.free - self.reserved)


def device_memory(device: torch.device | None) -> DeviceMemory | None:
    """The driver's count of ``device``'s memory with this process's share; None off CUDA, or
    where CUDA cannot say."""
    if device is None or device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
    except (RuntimeError, AssertionError):
        return None
    return DeviceMemory(int(free), int(total), int(reserved))


def retry_while_held(attempt: Callable[[], T], device: Callable[[], torch.device | None], within_s: float, who: str,
                     what: str, undo: Callable[[], None] | None = None) -> T:
    """``attempt()``; where it runs out of GPU memory while at least :data:`OUTSIDE_FLOOR` of the
    device (``device()``, asked after the failure) is held outside this process, ``undo()`` what it
    left, wait for that memory to come free and try again, within ``within_s`` seconds in all
    (see the module docs). ``who`` and ``what`` name the rank and the call in the log."""
    deadline = time.monotonic() + float(within_s)
    waited = 0.0
    while True:
        try:
            result = attempt()
        except torch.OutOfMemoryError:
            where = device()
            held = device_memory(where)
            if held is None or held.outside < OUTSIDE_FLOOR or time.monotonic() >= deadline:
                raise
            log.warning("%s ran out of GPU memory in %s with %.1f GiB of the device's %.1f GiB held outside this "
                        "process (a process this one replaced, not yet released, or another job): waiting up to "
                        "%.1f s for it to come free", who, what, held.outside / GIB, held.total / GIB,
                        deadline - time.monotonic())
        else:
            if waited:
                log.warning("%s finished %s after waiting %.1f s for the memory held outside this process to come "
                            "free", who, what, waited)
            return result
        # Out of the handler: the failed attempt's frames, and the tensors they held, are gone.
        if undo is not None:
            undo()
        _free_cached(where)
        started = time.monotonic()
        wait_for_release(where, held.outside, deadline)
        waited += time.monotonic() - started


def builds_when_memory_frees(method):
    """Decorate a role worker's model build (``init_model``; ``self.cfg``, ``self.role``,
    ``self.rank``, the device plan in ``self._plan``): :func:`retry_while_held` within
    ``recovery.restart_timeout_s``. The build must start by dropping what an earlier build left, as
    ``init_model`` does."""

    @functools.wraps(method)
    def build(self, *args, **kwargs):
        return retry_while_held(lambda: method(self, *args, **kwargs),
                                lambda: getattr(getattr(self, "_plan", None), "device", None),
                                self.cfg.recovery.restart_timeout_s, f"{self.role} rank {self.rank}", method.__name__)

    return build


def forget_optimizer_state(engine) -> None:
    """Undo what a restore of ``engine``'s state that ran out of memory left half made: the
    optimizer's state (the next attempt creates it again, as the first restore of a rebuilt rank
    does) and any gradients. The weights need nothing: a restore writes every one of them."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None:
        optimizer.state.clear()
        optimizer.zero_grad(set_to_none=True)


def wait_for_release(device: torch.device, outside: int, deadline: float) -> bool:
    """Wait until the memory held outside this process on ``device`` has dropped by
    :data:`CAME_FREE` from ``outside`` and settled, or until ``deadline`` (``time.monotonic``).
    Whether it came free."""
    last = None
    while time.monotonic() < deadline:
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        progress.advance("held memory")  # waiting is progress: the rank is not hung
        held = device_memory(device)
        if held is None:
            return False
        if held.outside <= outside - CAME_FREE and last is not None and abs(held.outside - last) < SETTLED:
            return True
        last = held.outside
    return False


def _free_cached(device: torch.device | None) -> None:
    """Free what a failed attempt left: its reference cycles (FSDP modules hold some), then the
    blocks the caching allocator keeps, so that the next reading counts only other processes."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
