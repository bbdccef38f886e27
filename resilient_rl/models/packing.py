"""Packed sequences: several sequences laid end to end in one row, told apart by their positions.

A packed row carries no attention mask; each sequence's ``position_ids`` start again at 0, as
Hugging Face's packed-sequence convention has it (``masking_utils.find_packed_sequence_indices``):
a position that does not follow the previous one by 1 starts a new sequence, and so does the first
token of every row. Attention is causal within a sequence and never crosses into another, so each
sequence computes what it would alone, with no padding; :mod:`resilient_rl.models.varlen` computes
it from the :class:`PackedLayout` of the rows, without a ``T x T`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedLayout", "packed_layout"]


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where the sequences of packed rows ``[batch, seq]`` lie once the rows are laid end to end
    (``batch * seq`` tokens, row after row).

    ``lengths``: each sequence's length, in order (they sum to ``batch * seq``). ``cu_seqlens``:
    int32 ``[N+1]`` offsets of the sequences (0, then the running sum of ``lengths``).
    ``sequence_ids``: int32 ``[batch * seq]``, the index of each token's sequence. Both tensors are
    on the positions' device.
    """

    batch: int
    seq: int
    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    sequence_ids: torch.Tensor


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
