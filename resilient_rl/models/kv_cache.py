"""Preallocated key/value caches for the rollout engine.

:class:`StaticKVCache` is the built-in tiny model's cache: one ``[batch, heads, max_len, head_dim]``
key and value buffer per layer, allocated once, written in place column by column, so a decode
step always sees the same shapes (a CUDA graph can replay it). Hugging Face models use
transformers' own ``StaticCache``; :func:`select_cache_rows` works on both, since the engine only
ever changes a cache in one way: keeping, repeating or dropping batch rows (repeating a shared
prompt's prefill for its samples, dropping finished rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from resilient_rl.errors import ModelInputError

__all__ = ["StaticKVCache", "select_cache_rows"]


@dataclass
class StaticKVCache:
    """Per-layer key and value buffers ``[batch, heads, max_len, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "StaticKVCache":
        """Zeroed buffers (zeros, not garbage: a masked key must not hold a NaN that SDPA could
        multiply by a zero weight)."""
        shape = (batch, heads, max_len, head_dim)
        return cls([_static(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)],
                   [_static(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)])

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat) the batch rows ``index`` ``[B']`` of every buffer."""
        self.keys = [_static(k.index_select(0, index)) for k in self.keys]
        self.values = [_static(v.index_select(0, index)) for v in self.values]


def select_cache_rows(cache, index: torch.Tensor) -> None:
    """Keep (or repeat) the batch rows ``index`` of a :class:`StaticKVCache` or of a transformers
    ``StaticCache`` (whose layers hold ``keys``/``values`` once initialised by a first forward)."""
    if isinstance(cache, StaticKVCache):
        cache.select_rows(index)
        return
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ModelInputError(f"cannot select rows of a {type(cache).__name__}: expected a StaticKVCache or "
                              "a transformers StaticCache")
    for layer in layers:
        if not getattr(layer, "is_initialized", False):
            raise ModelInputError("cannot select rows of a transformers cache layer before its first forward")
        layer.keys = _static(layer.keys.index_select(0, index))
        layer.values = _static(layer.values.index_select(0, index))
        if hasattr(layer, "batch_size"):
            layer.batch_size = int(index.shape[0])


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tag a buffer that is mutated in place as having a fixed address, so that a compiled decode
    step captured in a CUDA graph reads and writes it directly instead of copying it each replay."""
    if t.is_cuda:
        torch._dynamo.mark_static_address(t)
    return t
