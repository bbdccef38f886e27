"""Token sampling that stays on the device: no host synchronisation, no ``torch.multinomial``.

A categorical draw is taken as ``argmax(p / q)`` with ``q ~ Exp(1)`` per vocabulary entry (the
exponential race, equivalent to the Gumbel-max trick): the same distribution as ``multinomial``,
computed with elementwise ops and one reduction, and with a fixed number of random numbers per row
(the vocabulary size), so the stream a seeded generator yields depends only on the batch shapes.
"""

from __future__ import annotations

import torch

__all__ = ["sample_tokens", "top_p_filter"]

#: Smallest exponential draw used: an exact 0 would divide a filtered (zero) probability into NaN.
_MIN_DRAW = 1e-20


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches ``top_p`` (the most likely token
    is always kept; a stable sort keeps ties in index order, so the filter is deterministic)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop[..., 0] = False
    return torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs.masked_fill(drop, 0.0))


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]``; ``temperature == 0`` is greedy (no draws)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
    draws = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=_MIN_DRAW)
    return probs.div_(draws).argmax(dim=-1)
