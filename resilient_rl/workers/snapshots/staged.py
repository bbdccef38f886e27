"""A packed snapshot written into a rank's GPU tensors through two small page-locked buffers.

A restore writes a packed copy (:mod:`resilient_rl.workers.snapshots.buffers`) back into the rank's
tensors. The copy the rank took itself lies in its ring's page-locked buffer, which the GPU reads
directly. Every other copy lies in pageable memory: the one a rank left in node memory, which the
process that replaces it maps; one read from the object store; one handed over by a peer. From
pageable memory a ``copy_`` goes through the driver's own staging, one synchronous transfer per
tensor: the H200's SIGKILL recovery wrote 6.47 GB that way in about 2.2 s, about 3 GB/s.

:func:`staged_copy` sends the packed bytes through two page-locked buffers of
:data:`STAGE_BYTES` in turn. The host copies one window of the packed buffer into one of them (one
contiguous memory copy), then queues the device's copies of every tensor's bytes that lie in the
window, asynchronously (a tensor larger than a window is written in pieces, one per window); the
host fills the other buffer while the device reads the first. Every byte crosses once, and only
``2 * STAGE_BYTES`` are locked (torch's caching host allocator keeps them for the next restore).

The same code runs with destinations on the host, where nothing is locked and each copy is
synchronous: that is how the tests run it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from resilient_rl.runtime import progress

__all__ = ["STAGE_BYTES", "bytes_of", "staged_copy", "wants_staging"]

logger = logging.getLogger(__name__)

#: Bytes of each of the two page-locked buffers (a power of two: torch's caching host allocator
#: rounds a block up to one).
STAGE_BYTES = 64 << 20


def wants_staging(flat: torch.Tensor, dst: Sequence[torch.Tensor]) -> bool:
    """Whether writing the packed host buffer ``flat`` into ``dst`` should go through
    :func:`staged_copy`: some destination is on a GPU and ``flat`` is pageable."""
    return any(t.is_cuda for t in dst) and not flat.is_pinned()


def staged_copy(flat: torch.Tensor, offsets: Sequence[int], dst: Sequence[torch.Tensor],
                stage_bytes: int | None = None, pin: bool | None = None) -> None:
    """``dst[i]`` (in place) from the bytes of the flat uint8 host tensor ``flat`` that start at
    ``offsets[i]`` (ascending, as a packed layout's), through two buffers of ``stage_bytes``
    (default :data:`STAGE_BYTES`; page-locked when ``pin``, None: where a destination is on a GPU). Returns once every copy is
    complete. A destination that is not contiguous is copied directly from its bytes in ``flat``."""
    if len(offsets) != len(dst):
        raise ValueError(f"staged copy: {len(offsets)} offsets for {len(dst)} tensors")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError("staged copy: offsets must ascend")
    cuda = sorted({t.device for t in dst if t.is_cuda}, key=str)
    if len(cuda) > 1:
        raise ValueError(f"staged copy: destinations on {len(cuda)} devices ({', '.join(map(str, cuda))})")
    pin = bool(cuda) if pin is None else pin
    with torch.no_grad():
        staged = [(o, bytes_of(t)) for o, t in zip(offsets, dst) if t.is_contiguous()]
        for o, t in zip(offsets, dst):
            if not t.is_contiguous():
                n = t.numel() * t.element_size()
                t.copy_(flat[o:o + n].view(t.dtype).view(t.shape))
        if staged:
            _through_stages(flat, staged, stage_bytes or STAGE_BYTES, pin, cuda[0] if cuda else None)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous tensor ``t`` as a flat uint8 view (a 0-dim tensor's too)."""
    return t.reshape(-1).view(torch.uint8)


def _stages(nbytes: int, pin: bool) -> list[torch.Tensor]:
    """Two host buffers of ``nbytes``, page-locked when ``pin`` and the driver allows it (else
    pageable, logged once: the copies stay correct, at the driver's pageable rate)."""
    if pin:
        try:
            return [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        except RuntimeError as exc:
            if not _REFUSED:
                _REFUSED.append(str(exc))
                logger.warning("snapshot restore: page-locked staging refused (%s); copying from pageable memory",
                               str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]


#: Why this process could not page-lock its staging buffers, once it could not.
_REFUSED: list[str] = []


def _through_stages(flat: torch.Tensor, staged: list[tuple[int, torch.Tensor]], stage_bytes: int, pin: bool,
                    device: torch.device | None) -> None:
    begin = staged[0][0]
    end = max(o + b.numel() for o, b in staged)
    stages = _stages(min(stage_bytes, end - begin), pin)
    read: list = [None, None]  # the event after the device's last reads of each stage
    first = 0  # the first entry not yet wholly copied
    for window, start in enumerate(range(begin, end, stage_bytes)):
        stop = min(start + stage_bytes, end)
        buf = stages[window % 2]
        if read[window % 2] is not None:
            read[window % 2].synchronize()  # the device is done with this stage's last window
        buf[:stop - start].copy_(flat[start:stop])
        i = first
        while i < len(staged) and staged[i][0] < stop:
            offset, out = staged[i]
            lo, hi = max(offset, start), min(offset + out.numel(), stop)
            if lo < hi:
                out[lo - offset:hi - offset].copy_(buf[lo - start:hi - start], non_blocking=out.is_cuda)
            if offset + out.numel() <= stop and i == first:
                first += 1
            i += 1
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            read[window % 2] = event
        progress.advance("snapshot")
    for event in read:
        if event is not None:
            event.synchronize()
