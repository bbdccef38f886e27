"""Micro-batches sized by tokens, not rows, with the padding no row of a micro-batch needs removed.

Prompts are left-padded to the batch's longest prompt and responses right-padded to the longest
response, so a row-count micro-batch costs ``rows x batch width`` whatever its rows hold. Here a
mini-batch is cut, in order, into runs of rows whose cost ``rows x longest unpadded row`` stays
within ``micro_batch_tokens`` (a row longer than the budget gets a micro-batch alone), and each
micro-batch drops the leading columns that are padding in every one of its rows. Positions are
kept (``position_ids`` are explicit), pad keys are masked anyway, and the response columns, which
every loss reads from the end of the sequence, are untouched: the result per token is the same
function of the real tokens (equal up to floating-point summation order on CPU).
"""

from __future__ import annotations

import torch

__all__ = ["count", "cut_to", "micro_batches", "row_lengths", "split", "trim_left_padding"]

# Keys laid out over the whole sequence (prompt + response); the others are per response token
# or per row and are never trimmed.
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def row_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the columns from its first real token to the end (what its computation needs)."""
    width = attention_mask.shape[1]
    first = torch.argmax((attention_mask != 0).to(torch.int8), dim=1)
    return width - first


def micro_batches(attention_mask: torch.Tensor, max_tokens: int | None, packed: bool = False) -> list[tuple[int, int]]:
    """Contiguous ``(start, end)`` row ranges covering the batch, each costing at most
    ``max_tokens``, except a single row longer than that; ``None``: one range. The cost is rows x
    longest row (padded), or with ``packed`` the sum of the rows' real tokens (packed sequences)."""
    rows = attention_mask.shape[0]
    if max_tokens is None or rows == 0:
        return [(0, rows)]
    lengths = (attention_mask != 0).sum(dim=1).tolist() if packed else row_lengths(attention_mask).tolist()
    ranges, start, longest, total = [], 0, 0, 0
    for i, length in enumerate(lengths):
        longest_with, total_with = max(longest, length), total + length
        cost = total_with if packed else (i - start + 1) * longest_with
        if i > start and cost > max_tokens:
            ranges.append((start, i))
            start, longest_with, total_with = i, length, length
        longest, total = longest_with, total_with
    ranges.append((start, rows))
    return ranges


def count(attention_mask: torch.Tensor, max_tokens: int | None, packed: bool = False) -> int:
    """How many micro-batches :func:`split` makes of a batch with ``attention_mask``."""
    return len(micro_batches(attention_mask, max_tokens, packed))


def cut_to(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``ranges`` with the one of most rows cut in halves until there are ``n`` (as many as the
    rows allow). Ranks of an FSDP2 group must run as many micro-batches as each other: every
    forward and backward is a collective, so a rank with fewer would leave its peers waiting in
    one, or pair two different collectives. Smaller micro-batches stay within the budget."""
    ranges = list(ranges)
    while len(ranges) < n:
        i = max(range(len(ranges)), key=lambda j: ranges[j][1] - ranges[j][0])
        start, end = ranges[i]
        if end - start < 2:
            break
        mid = start + (end - start) // 2
        ranges[i:i + 1] = [(start, mid), (mid, end)]
    return ranges


def trim_left_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` without the leading columns that are padding in every row (see module docs)."""
    mask = batch["attention_mask"]
    if mask.shape[0] == 0:
        return dict(batch)
    drop = int(mask.shape[1] - row_lengths(mask).max())
    if drop <= 0:
        return dict(batch)
    return {k: (v[:, drop:] if k in _SEQUENCE_KEYS else v) for k, v in batch.items()}


def split(batch: dict[str, torch.Tensor], max_tokens: int | None, packed: bool = False,
          at_least: int = 1) -> list[dict[str, torch.Tensor]]:
    """``batch`` (tensors with rows first) as token-sized, trimmed micro-batches; ``None`` keeps it
    whole. ``packed``: sized for packed sequences (their padding is never computed, so not trimmed).
    ``at_least``: cut further to that many micro-batches (:func:`cut_to`)."""
    if max_tokens is None:
        return [dict(batch)]
    ranges = cut_to(micro_batches(batch["attention_mask"], max_tokens, packed), at_least)
    parts = [{k: v[s:e] for k, v in batch.items()} for s, e in ranges]
    return parts if packed else [trim_left_padding(p) for p in parts]
