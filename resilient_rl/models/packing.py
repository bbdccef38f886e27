"""Packed sequences: several sequences laid end to end in one row, told apart by their positions.

A packed row carries no attention mask; each sequence's ``position_ids`` start again at 0, as
Hugging Face's mask construction expects (``masking_utils.find_packed_sequence_indices``, applied
only to a call without a cache: ``use_cache=False``): a position that does not follow the previous
one by 1 starts a new sequence. The built-in tiny model reads packed rows the same way. Attention is causal
within a sequence and never crosses into another, so each sequence computes what it would alone,
with no padding.
"""

from __future__ import annotations

import torch

__all__ = ["packed_causal_mask", "sequence_ids"]


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: for each token, the index of its sequence within the row (0, 0, 1, 1, 1, 2, ...)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` mask (True = attend): causal and within the token's own sequence."""
    seq = position_ids.shape[1]
    ids = sequence_ids(position_ids)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (causal[None] & (ids[:, :, None] == ids[:, None, :]))[:, None]
