"""Token sampling that stays on the device: no host synchronisation, no ``torch.multinomial``.

A categorical draw is taken by inverting the cumulative distribution: one uniform number per row,
scaled to the row's total mass, located in the row's running sum with ``searchsorted``. That is the
distribution ``multinomial`` samples, computed with a scan and a binary search, with exactly one
random number per row (drawing one per vocabulary entry, as an exponential race or Gumbel-max
does, costs more than the rest of a small model's decode step on CPU). A seeded generator
therefore yields a stream that depends only on the rows sampled at each step.

The draw (:func:`draw_uniform`, which needs the generator) is apart from the pick
(:func:`pick_tokens`, a pure function of logits and draws), so the rollout engine picks inside its
compiled decode step: the softmax, the nucleus filter's sort and the search run in the step's
graph, not as separate eager kernels every token.
"""

from __future__ import annotations

import torch

__all__ = ["draw_uniform", "pick_tokens", "sample_tokens", "top_p_filter"]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches ``top_p`` (the most likely token
    is always kept; a stable sort keeps ties in index order, so the filter is deterministic)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop[..., 0] = False
    return torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs.masked_fill(drop, 0.0))


def draw_uniform(rows: int, temperature: float, generator: torch.Generator | None,
                 device: torch.device | str) -> torch.Tensor | None:
    """One uniform number per row ``[rows, 1]`` from ``generator``; None when greedy (no draws)."""
    if temperature == 0:
        return None
    return torch.rand((rows, 1), generator=generator, device=device)


def pick_tokens(logits: torch.Tensor, temperature: float, top_p: float, draw: torch.Tensor | None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` for the uniform numbers ``draw`` ``[B, 1]``
    (None: greedy)."""
    logits = logits.float()
    if draw is None:
        return logits.argmax(dim=-1)
    probs = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
    cdf = probs.cumsum(dim=-1)
    # The first entry whose running sum exceeds the draw: a zero-probability token never is (its
    # sum equals its predecessor's); the clamp covers a draw rounding up to the total.
    return torch.searchsorted(cdf, draw * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]``; ``temperature == 0`` is greedy (no draws)."""
    return pick_tokens(logits, temperature, top_p, draw_uniform(logits.shape[0], temperature, generator,
                                                                  logits.device))
