"""The ``"flex"`` backend of packed attention (:mod:`resilient_rl.models.varlen`): compiled
``flex_attention`` under a document-causal ``BlockMask`` built from the sequence boundaries at
block granularity, never from an ``N x N`` mask."""

from __future__ import annotations

import torch

from resilient_rl.models.packing import PackedLayout

#: Tokens per block of the block mask.
BLOCK = 128

_FLEX: list = []


def _compiled_flex():
    """``flex_attention`` compiled once per process; without compiling it would materialise the scores."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _FLEX[0]


def document_block_mask(layout: PackedLayout, device: torch.device):
    """The document-causal ``BlockMask`` of ``layout``'s tokens end to end (``[1, 1, N, N]``),
    built from each block's first and last sequence, never from an ``N x N`` mask."""
    from torch.nn.attention.flex_attention import BlockMask

    ids = layout.sequence_ids.to(device)
    total = ids.numel()
    blocks = -(-total // BLOCK)
    begin = torch.arange(blocks, device=device) * BLOCK
    first = ids[begin]
    last = ids[(begin + BLOCK).clamp(max=total) - 1]
    q_block = torch.arange(blocks, device=device)[:, None]
    kv_block = torch.arange(blocks, device=device)[None, :]
    # Sequence ids never decrease along the tokens: an earlier key block shares a sequence with
    # a query block exactly when its last sequence is the query block's first.
    visited = (kv_block <= q_block) & (last[None, :] >= first[:, None])
    # Both blocks inside one sequence and the key block strictly earlier: every pair attends.
    full = (kv_block < q_block) & (first[None, :] == last[:, None])
    partial = visited & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count[None, None].contiguous(), indices[None, None].contiguous()

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    kv_count, kv_indices = ordered(partial)
    full_count, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(kv_count, kv_indices, full_count, full_indices, BLOCK_SIZE=BLOCK,
                                    mask_mod=document_causal, seq_lengths=(total, total))


def flex_packed_attention(q, k, v, layout: PackedLayout, scale: float | None) -> torch.Tensor:
    """Document-causal attention of ``[1, heads, N, D]`` tokens end to end, through compiled
    ``flex_attention`` under :func:`document_block_mask`."""
    mask = document_block_mask(layout, q.device)
    return _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
