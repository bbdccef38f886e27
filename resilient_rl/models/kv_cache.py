"""The rollout engine's KV cache: per-layer key and value buffers allocated once and kept.

Buffers are ``[capacity rows, kv_heads, columns, head_dim]``, with ``columns`` a multiple of the
decode attention's block. A generation uses the first rows of them, and a decode step the first
columns up to its own (views at the buffers' own addresses), and changes them in one way only:
keeping, repeating or dropping batch rows, done in place (:meth:`EngineCache.take_rows`). So the addresses never change, within a generation or from
one rollout to the next, and a decode step captured in a CUDA graph reads and writes the buffers
directly: a fresh cache each rollout would force the graphs to be recorded again.

Buffers only grow (more rows, more columns): a longer batch reallocates once, and every later one
of that size or smaller reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CacheShape", "EngineCache", "PAD_COLUMNS"]

#: Columns a buffer holds past its capacity, never written or read (see EngineCache.__init__).
PAD_COLUMNS = 1


@dataclass(frozen=True)
class CacheShape:
    """What a model's cache holds per row and column."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_row(self, columns: int) -> int:
        """Bytes of keys and values one row of ``columns`` columns takes over all layers."""
        return 2 * self.layers * self.kv_heads * columns * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class EngineCache:
    """Key and value buffers of one model, reused by every generation (see the module docstring)."""

    def __init__(self, shape: CacheShape, rows: int, columns: int):
        self.shape = shape
        self.columns = columns
        # One column more than is ever used: a view of the first columns is never contiguous, also
        # when it takes all ``columns``, so the compiled step sees the same strides for every span
        # (a contiguous one would be a new case to it, and a recompile).
        size = (rows, shape.kv_heads, columns + PAD_COLUMNS, shape.head_dim)
        # Zeros, not garbage: a masked column's weight is 0, and 0 x NaN would still be NaN.
        self.keys = [_static(torch.zeros(size, dtype=shape.dtype, device=shape.device)) for _ in range(shape.layers)]
        self.values = [_static(torch.zeros(size, dtype=shape.dtype, device=shape.device))
                       for _ in range(shape.layers)]
        self.rows = 0  # rows in use by the current generation

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) the buffers hold."""
        return self.keys[0].shape[0], self.columns

    def fits(self, shape: CacheShape, rows: int, columns: int) -> bool:
        cap_rows, cap_columns = self.capacity
        return self.shape == shape and rows <= cap_rows and columns <= cap_columns

    def views(self, rows: int | None = None,
              columns: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The first ``rows`` (default: those in use) rows and ``columns`` (default: all) columns of
        every layer, at the buffers' addresses."""
        rows = self.rows if rows is None else rows
        columns = self.capacity[1] if columns is None else columns
        return ([_static(k[:rows, :, :columns]) for k in self.keys],
                [_static(v[:rows, :, :columns]) for v in self.values])

    def take_rows(self, index: torch.Tensor) -> None:
        """Make the rows in use ``index`` ``[R]`` of the current ones (keep, repeat or drop), in place."""
        rows = int(index.shape[0])
        for buf in self.keys + self.values:
            buf[:rows].copy_(buf[:self.rows].index_select(0, index))
        self.rows = rows


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tag a buffer that is mutated in place as having a fixed address, so that a compiled decode
    step captured in a CUDA graph reads and writes it directly instead of copying it each replay.
    Unguarded: a new view of the same buffer (after a compaction, in the next rollout) reuses the
    compiled step; a guarded tag would recompile for every new tensor object. Tagged on every
    device, so the CPU runs the path a GPU runs (the tag only matters to CUDA graphs)."""
    torch._dynamo.mark_static_address(t, guard=False)
    return t
