"""The dtype an operator computes a tensor in under autocast."""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matrix product or attention computes floating-point ``x`` in: autocast's where
    it is on for ``x``'s device, else ``x``'s own. Under autocast over fp32 weights a Hugging Face
    model's query and key come out of the rotary embedding in fp32 (the half-precision projection
    times fp32 ``cos``/``sin``), and the head's weight stays fp32, though both compute in bf16."""
    kind = x.device.type
    if x.dtype.is_floating_point and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype
