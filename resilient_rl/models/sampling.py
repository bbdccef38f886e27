"""Token sampling that stays on the device: no host synchronisation, no ``torch.multinomial``.

A categorical draw is taken by inverting the cumulative distribution: one uniform number per row,
scaled to the row's total mass, located in the row's running sum with ``searchsorted``. That is the
distribution ``multinomial`` samples, computed with a scan and a binary search, with exactly one
random number per row (drawing one per vocabulary entry, as an exponential race or Gumbel-max
does, costs more than the rest of a small model's decode step on CPU). A seeded generator
therefore yields a stream that depends only on the rows sampled at each step.

In the compiled decode step the running sum is taken in two levels (:func:`pick_from_weights`):
over blocks of :data:`BLOCK` entries, then inside the one block the draw falls in, so no running
sum as wide as the vocabulary is ever written. Without a nucleus filter the weights are the
unnormalised ``exp((logits - max) / T)`` (no softmax division), computed where they are summed and
again for the one block searched. For Qwen2.5's 151,936 ids and 512 rows a full-width fp32 running
sum is 311 MB written and read again every decode step, after as much for the probabilities; the
two levels write ``rows x 149`` sums and ``rows x 1024`` weights. ``python bench/sampling.py``
(64 rows of 151,936 ids, 2-core CPU, inductor): 7.2 ms against 62.7 ms for the full-width pass
(0.11x), the same token in every row. Eager, each of the two levels' operations writes its result
(78.1 ms against 54.1 ms, ``--eager``), so an eager pick keeps the full-width pass.

The draw (:func:`draw_uniform`, which needs the generator) is apart from the pick
(:func:`pick_tokens`, a pure function of logits and draws), so the rollout engine picks inside its
compiled decode step: the exponentials, the nucleus filter's sort and the search run in the step's
graph, not as separate eager kernels every token.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK", "draw_uniform", "pick_from_weights", "pick_tokens", "sample_tokens", "top_p_filter"]

#: Vocabulary entries per block of the two-level search.
BLOCK = 1024


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
    (None: greedy). Compiled, by :func:`pick_from_weights`; eager, by one running sum over the
    whole row, which is faster there (a fused softmax and a scan, against each of the two levels'
    operations writing its own result): the same inverse CDF, a token apart only where fp32
    rounding puts a draw on a boundary."""
    logits = logits.float()
    if draw is None:
        return logits.argmax(dim=-1)
    compiling = torch.compiler.is_compiling()
    if compiling and top_p >= 1.0:
        # The weights exp((logits - max) / T) are computed where they are summed and again for the one
        # block searched, never written out whole.
        return pick_from_weights(logits, draw, top=logits.amax(dim=-1, keepdim=True), temperature=temperature)
    probs = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
    if compiling:
        return pick_from_weights(probs, draw)
    cdf = probs.cumsum(dim=-1)
    # The first entry whose running sum exceeds the draw: a zero-probability token never is (its
    # sum equals its predecessor's); the clamp covers a draw rounding up to the total.
    return torch.searchsorted(cdf, draw * cdf[:, -1:], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def pick_from_weights(values: torch.Tensor, draw: torch.Tensor, block: int = BLOCK, top: torch.Tensor | None = None,
                      temperature: float = 1.0) -> torch.Tensor:
    """The entry of each row of ``values`` ``[B, V]`` where the running sum of its weights first
    exceeds ``draw`` ``[B, 1]`` times their total. The weights are the values (non-negative,
    unnormalised, each row with some positive weight), or with ``top`` ``[B, 1]`` (the rows'
    maxima) ``exp((values - top) / temperature)`` of logits. The running sum of the blocks of
    ``block`` entries locates the block, the block's own running sum the entry. An entry of zero
    weight is never picked, also when rounding puts the draw at the very end of a row or block."""
    rows, vocab = values.shape
    block = min(block, vocab)
    pad = 0.0 if top is None else -math.inf  # a padded entry weighs 0
    blocks = torch.nn.functional.pad(values, (0, -vocab % block), value=pad).view(rows, -1, block)
    top = None if top is None else top[:, :, None]
    mass = _weights(blocks, top, temperature).sum(dim=-1)  # [B, blocks]
    running = mass.cumsum(dim=-1)
    target = draw * running[:, -1:]
    # The first block whose running sum exceeds the target, at most the last one with any mass.
    last = (running < running[:, -1:]).sum(dim=-1, keepdim=True)
    at = torch.minimum(torch.searchsorted(running, target, right=True), last)  # [B, 1]
    rest = target - (running.gather(1, at) - mass.gather(1, at))
    chosen = blocks.gather(1, at[:, :, None].expand(rows, 1, block))
    inside = _weights(chosen, top, temperature).squeeze(1).cumsum(dim=-1)  # [B, block]
    last_inside = (inside < inside[:, -1:]).sum(dim=-1, keepdim=True)
    entry = torch.minimum(torch.searchsorted(inside, rest, right=True), last_inside)
    return (at * block + entry).squeeze(1)


def _weights(blocks: torch.Tensor, top: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """:func:`pick_from_weights`'s weights of ``blocks`` ``[B, n, block]``."""
    return blocks if top is None else torch.exp((blocks - top) / temperature)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]``; ``temperature == 0`` is greedy (no draws)."""
    return pick_tokens(logits, temperature, top_p, draw_uniform(logits.shape[0], temperature, generator,
                                                                  logits.device))
