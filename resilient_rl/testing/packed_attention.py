"""What the packed-attention tests compare against: a row of sequences of mixed lengths, and
attention computed one sequence at a time with SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU = torch.device("cpu")
LENGTHS = [1, 7, 30, 1, 19, 4]  # 62 tokens; single-token sequences included


def reference_attention(q, k, v, lengths):
    """Causal attention of each sequence alone (``[B, h, T, D]``, sequences end to end along ``T``);
    grouped key/value heads repeated to the query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True)
                      for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], 2)
