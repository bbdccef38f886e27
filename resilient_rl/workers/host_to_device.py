"""A host tensor on the device without making the host wait for the device.

A copy from pageable host memory to a GPU starts only once the device has finished the work
queued before it (CUDA synchronises the stream first), and the device then idles until the host
has launched again. A worker moves each micro-batch's tensors after the previous micro-batch's
forward and backward were launched, so every such copy was a wait on a whole pass. From pinned
memory the copy is queued with the rest of the work and the host goes on: :func:`to_device` pins
the tensor first (torch's caching host allocator reuses the pinned blocks, and keeps each until
the copies that read it have run). On a CPU, or for a tensor already on the device, it is
``tensor.to(device)``.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU through pinned memory, without a wait."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
