"""Batched autoregressive generation for causal LMs (the built-in tiny model and Hugging Face models).

Prompts arrive left-padded, so every row's next token is written in the same column. The routine
prefills the prompt once and then feeds one token per step with the KV cache (or recomputes the
whole sequence when ``use_cache=False``, which is the reference the cached path is tested against).
Sampling draws from an explicit :class:`torch.Generator`, so a seeded generator reproduces the same
tokens on CPU bit for bit; the generator's state is what a rollout worker checkpoints.

Responses always have exactly ``max_new_tokens`` columns (padded after the end-of-sequence token)
so that every rollout batch has a fixed shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resilient_rl.runtime import progress
from resilient_rl.errors import ConfigError, ModelInputError

__all__ = ["GenerationOutput", "compute_position_ids", "generate", "sample_next_token"]

#: Tokens per progress report (liveness): a long generation advances, so it is never taken for a hang.
TOKEN_BLOCK = 8


@dataclass
class GenerationOutput:
    """The result of :func:`generate`.

    Attributes:
        sequences: ``[B, P+R]`` prompt followed by the response (``pad_token_id`` after eos).
        responses: ``[B, R]`` the generated tokens, ``R == max_new_tokens``.
        response_mask: ``[B, R]`` 1 for generated tokens up to and including the eos token, 0 after.
        attention_mask: ``[B, P+R]`` the prompt mask followed by ``response_mask``.
        position_ids: ``[B, P+R]`` the prompt positions, then positions continuing from the last
            prompt token (also under the padding after eos, which the mask hides).
        engine_stats: the static engine's counters for this generation (see
            :class:`resilient_rl.models.decode_step.DecodeStats`); None from the plain loop.
    """

    sequences: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    engine_stats: dict | None = None


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``cumsum(attention_mask) - 1``, clamped at 0.

    A left-padded row then gets the same positions for its real tokens as the unpadded row;
    padding positions are 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from ``logits`` ``[B, V]``.

    ``temperature == 0`` is greedy (argmax, no random numbers drawn). Otherwise the logits are
    divided by ``temperature``, filtered to the smallest set of tokens whose probability mass
    reaches ``top_p`` (the most likely token is always kept), and sampled with
    ``torch.multinomial(generator=generator)``.
    """
    _check_sampling_args(temperature, top_p)
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        # A stable sort keeps ties in index order, so filtering is deterministic.
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> GenerationOutput:
    """Generate ``max_new_tokens`` tokens for a batch of left-padded prompts.

    ``model`` is called with the Hugging Face convention (``input_ids``, ``attention_mask``,
    ``position_ids``, ``past_key_values``, ``use_cache``) and must return an object with
    ``.logits`` and ``.past_key_values``; both :class:`~resilient_rl.models.tiny.TinyCausalLM`
    and Hugging Face causal LMs do. ``eos_token_id`` may be one id or several. Generation stops
    early once every row has produced an eos token; the remaining columns are ``pad_token_id``.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ModelInputError(
            f"generate: input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [batch, prompt_len]")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    _check_sampling_args(temperature, top_p)

    batch, _ = input_ids.shape
    device = input_ids.device
    mask_dtype = attention_mask.dtype
    prompt_mask = attention_mask.long()
    prompt_pos = compute_position_ids(prompt_mask)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, max_new_tokens + 1, device=device)
    eos_ids = _eos_tensor(eos_token_id, device)

    responses = torch.full((batch, max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=device)
    response_mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)

    # While generating, every generated token is attended to: a finished row's later tokens
    # are padding whose logits are ignored, so they need no masking until the final mask.
    seq, seq_mask, seq_pos = input_ids, prompt_mask, prompt_pos
    past: Any = None
    for step in range(max_new_tokens):
        if step % TOKEN_BLOCK == 0:
            progress.advance("tokens")
        if use_cache and past is not None:
            out = model(input_ids=seq[:, -1:], attention_mask=seq_mask, position_ids=seq_pos[:, -1:],
                        past_key_values=past, use_cache=True)
        else:
            out = model(input_ids=seq, attention_mask=seq_mask, position_ids=seq_pos, use_cache=use_cache)
        if use_cache:
            past = out.past_key_values
        sampled = sample_next_token(out.logits[:, -1, :], temperature, top_p, generator).to(input_ids.dtype)
        token = torch.where(finished, torch.full_like(sampled, pad_token_id), sampled)
        responses[:, step] = token
        response_mask[:, step] = (~finished).long()
        if eos_ids is not None:
            finished = finished | torch.isin(token, eos_ids)
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        # Finished rows are fed their sampled token, not the pad id: their logits are ignored,
        # and a pad id need not be a valid embedding index.
        seq = torch.cat([seq, sampled[:, None]], dim=1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], dim=1)
        seq_pos = torch.cat([seq_pos, response_pos[:, step:step + 1]], dim=1)

    return GenerationOutput(
        sequences=torch.cat([input_ids, responses], dim=1),
        responses=responses,
        response_mask=response_mask.to(mask_dtype),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1).to(mask_dtype),
        position_ids=torch.cat([prompt_pos, response_pos], dim=1),
    )


def _check_sampling_args(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ConfigError(f"generate: temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"generate: top_p must be in (0, 1], got {top_p!r}")


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device: torch.device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids:
        return None
    return torch.tensor(ids, dtype=torch.long, device=device)
