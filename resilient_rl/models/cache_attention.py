"""Attention of the rollout engine through its preallocated KV cache, for the tiny model and for
Hugging Face models alike.

A forward of the engine (the prefill of the prompts, or one decode step) writes the new keys and
values into the cache at the columns it covers and attends through the cache:

- **Prefill** (several query columns): over the prompt's columns only, under a causal mask that
  hides left padding; grouped-query heads are repeated for this one pass (it runs once per prompt).
- **Decode** (one query column): each key/value head is read once for all the query heads that
  share it (grouped-query attention as a grouped matrix product over the cache, no ``repeat_kv``),
  compiled or eager alike. The engine hands it the cache's columns up to the step's own, rounded
  up to a multiple of :data:`BLOCK` (a symbol of the compiled step): the masked columns of that
  span are read, the columns past it are not.

  Why not ``flex_attention`` with a block mask that skips the blocks past the current column: on
  an H200 (torch 2.11, Qwen2.5-0.5B's shape, 512 rows, 768 columns) its compiled decode kernel took
  5.2 ms per layer call, 128 ms per decode step against 21 ms for the whole step eager
  (``python bench/decode_profile.py``; ``docs/performance.md``), where reading the whole cache of
  a layer at the memory bandwidth takes 42 µs; compiled without CUDA graphs it also failed with an
  illegal memory access. The grouped product took 3.4 ms for the whole step (compiled, CUDA
  graphs, the same shape with a 384-column cache).

Hugging Face models reach this through an attention function registered with transformers'
``AttentionInterface`` under :data:`HF_ATTENTION` (:func:`engine_attention` switches a model to it
for the length of a generation): the model computes its projections and rotary embeddings as
always, then hands the new keys and values to :func:`cache_attention`, which owns the cache. The
model's own cache is not used (``use_cache=False``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "EngineStep", "HF_ATTENTION", "cache_attention", "decode_attention", "engine_attention"]

#: The cache length is a multiple of this many columns (aligned rows for the kernels).
BLOCK = 128
#: The name of the engine's attention function in transformers' ``AttentionInterface``.
HF_ATTENTION = "rrl_engine"


@dataclass
class EngineStep:
    """What one engine forward attends through.

    ``keys``/``values``: per layer ``[B, kv_heads, L, head_dim]`` buffers. ``columns``: the cache
    columns this forward writes (``[T]``). ``key_valid``: decode only, ``[B, L]`` bool, the columns
    a query may see (the prompt's real tokens and every token generated so far, this one included).
    ``prefill_mask``: prefill only, ``[B, 1, T, T]`` bool (causal, padding hidden).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    columns: torch.Tensor
    key_valid: torch.Tensor | None = None
    prefill_mask: torch.Tensor | None = None


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: EngineStep,
                    scale: float | None = None) -> torch.Tensor:
    """Write ``k``/``v`` ``[B, kv_heads, T, D]`` into layer ``layer`` of the cache at
    ``step.columns`` and attend ``q`` ``[B, heads, T, D]`` through it; returns ``[B, heads, T, D]``."""
    k_buf, v_buf = step.keys[layer], step.values[layer]
    k_buf.index_copy_(2, step.columns, k.to(k_buf.dtype))
    v_buf.index_copy_(2, step.columns, v.to(v_buf.dtype))
    if step.prefill_mask is not None:
        seq = q.shape[2]
        keys, values = k_buf[:, :, :seq], v_buf[:, :, :seq]
        groups = q.shape[1] // keys.shape[1]
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=step.prefill_mask,
                                              scale=scale)
    return decode_attention(q, k_buf, v_buf, step.key_valid, scale)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, key_valid: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One query column ``q`` ``[B, heads, 1, D]`` over the cache ``[B, kv_heads, L, D]`` under
    ``key_valid`` ``[B, L]``: the query heads of each key/value head as one group, so that each
    cached key and value is read once (see the module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, heads, _, dim = q.shape
    kv_heads = k_buf.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).to(k_buf.dtype)
    scores = torch.matmul(grouped, k_buf.transpose(-1, -2)).float() * scale  # [B, kv_heads, groups, L]
    scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(v_buf.dtype), v_buf)
    return out.reshape(batch, heads, 1, dim).to(q.dtype)


def _hf_attention(module, query, key, value, attention_mask, scaling=None, rrl_engine_step=None, **kwargs):
    """transformers' attention-function contract (outputs ``[B, T, heads, D]``, no weights): the
    engine's cache attention when a step is passed, else the model's usual SDPA attention."""
    if rrl_engine_step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    out = cache_attention(query, key, value, module.layer_idx, rrl_engine_step, scaling)
    return out.transpose(1, 2).contiguous(), None


_REGISTERED = []


@contextmanager
def engine_attention(model):
    """Run the Hugging Face ``model``'s attention through :func:`cache_attention` inside the block."""
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(HF_ATTENTION, _hf_attention)
        _REGISTERED.append(True)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = HF_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
