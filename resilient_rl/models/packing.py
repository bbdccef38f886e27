"""Packed sequences: several sequences laid end to end in one row, told apart by their positions.

A packed row carries no attention mask; each sequence's ``position_ids`` start again at 0, as
Hugging Face's packed-sequence convention has it (``masking_utils.find_packed_sequence_indices``):
a position that does not follow the previous one by 1 starts a new sequence, and so does the first
token of every row. Attention is causal within a sequence and never crosses into another, so each
sequence computes what it would alone, with no padding; :mod:`resilient_rl.models.varlen` computes
it from the :class:`PackedLayout` of the rows, without a ``T x T`` mask.

Finding the layout reads the sequence lengths back to the host. Where the positions were on the
host first (a worker's batch always is), the caller lays the rows out there and moves the layout
with the tokens (:meth:`PackedLayout.map_tensors`), then runs the forward under
:func:`given_layout`: the model's mask code takes that layout for those positions
(:func:`given_layout_of`, :func:`layout_of`) and reads nothing back from the device, which on a
GPU would wait for all the work queued before it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

__all__ = ["PackedLayout", "given_layout", "given_layout_of", "layout_of", "packed_layout"]

#: ``(positions, layout)`` of the packed forward in progress whose layout the caller found first.
_GIVEN: contextvars.ContextVar = contextvars.ContextVar("rrl_given_layout", default=None)


@dataclass(eq=False)
class PackedLayout:
    """Where the sequences of packed rows ``[batch, seq]`` lie once the rows are laid end to end
    (``batch * seq`` tokens, row after row).

    ``lengths``: each sequence's length, in order (they sum to ``batch * seq``). ``cu_seqlens``:
    int32 ``[N+1]`` offsets of the sequences (0, then the running sum of ``lengths``).
    ``sequence_ids``: int32 ``[batch * seq]``, the index of each token's sequence. Both tensors are
    on the positions' device.

    Not changed once made, though not a frozen dataclass: the compiler of torch 2.11 (and older)
    reads every field of a frozen dataclass that a compiled block is handed, and so guards on the
    number of sequences; a compiled block then compiled again for each packing.
    """

    batch: int
    seq: int
    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    sequence_ids: torch.Tensor

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PackedLayout":
        """The same layout with ``fn`` of each of its tensors (moved to a device, say); the
        lengths stay on the host."""
        return replace(self, cu_seqlens=fn(self.cu_seqlens), sequence_ids=fn(self.sequence_ids))


def packed_layout(position_ids: torch.Tensor) -> PackedLayout:
    """The :class:`PackedLayout` of packed rows given their ``position_ids`` ``[B, T]``.

    Reads the sequence lengths back to the host (one synchronisation), which the attention
    backends need as Python ints.
    """
    batch, seq = position_ids.shape
    flat = position_ids.reshape(-1)
    starts = torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
    starts[1:] = flat[1:] - flat[:-1] != 1
    if seq:
        starts.view(batch, seq)[:, 0] = True
    sequence_ids = (starts.cumsum(0) - 1).to(torch.int32)
    first = starts.nonzero().flatten()
    cu_seqlens = torch.cat([first, first.new_tensor([flat.numel()])]).to(torch.int32)
    lengths = tuple(torch.diff(cu_seqlens).tolist())
    return PackedLayout(batch, seq, lengths, cu_seqlens, sequence_ids)


@contextlib.contextmanager
def given_layout(position_ids: torch.Tensor, layout: PackedLayout) -> Iterator[None]:
    """Within this block, :func:`layout_of` of this very ``position_ids`` tensor is ``layout``."""
    token = _GIVEN.set((position_ids, layout))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def given_layout_of(position_ids: torch.Tensor) -> PackedLayout | None:
    """The layout given for this very ``position_ids`` tensor (:func:`given_layout`), else None."""
    given = _GIVEN.get()
    return given[1] if given is not None and given[0] is position_ids else None


def layout_of(position_ids: torch.Tensor) -> PackedLayout:
    """The layout of packed rows with ``position_ids``: the one given for this tensor
    (:func:`given_layout`), else :func:`packed_layout` (one read back from its device)."""
    given = given_layout_of(position_ids)
    return given if given is not None else packed_layout(position_ids)
