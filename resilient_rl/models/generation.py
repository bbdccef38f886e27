"""Batched autoregressive generation for causal LMs: the one decode loop and its plain mode.

Prompts arrive left-padded, so every row's next token is written in the same column. Every
generation, plain or by the rollout engine (:mod:`resilient_rl.models.engine`), runs
:func:`decode_loop`: it records one token per row per step, marks rows finished at an
end-of-sequence token, stops once every row has finished, and asks its decoder for the next
tokens. A decoder owns the model call, its cache and the sampling; the engine's also drops
finished rows from its batch (compaction).

:func:`generate` is the loop's plain mode: the model's own KV cache (or a whole-sequence forward
each step when ``use_cache=False``, which is the reference the cached paths are tested against),
sampling with ``torch.multinomial``, and a finish check every step. It runs any model with the
Hugging Face calling convention, including those the engine does not cover. Sampling draws from an
explicit :class:`torch.Generator`, so a seeded generator reproduces the same tokens on CPU bit for
bit; the generator's state is what a rollout worker checkpoints.

Responses always have exactly ``max_new_tokens`` columns (padded after the end-of-sequence token)
so that every rollout batch has a fixed shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resilient_rl.errors import ConfigError, ModelInputError
from resilient_rl.models.sampling import top_p_filter
from resilient_rl.runtime import progress

__all__ = ["GenerationOutput", "check_generate_args", "compute_position_ids", "decode_loop", "generate",
           "generation_output", "generation_positions", "sample_next_token"]

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


def generation_positions(attention_mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_pos, response_pos)``: the prompt's positions (:func:`compute_position_ids`) and
    the ``max_new_tokens`` positions after each row's last prompt token."""
    prompt_pos = compute_position_ids(attention_mask)
    return prompt_pos, prompt_pos[:, -1:] + torch.arange(1, max_new_tokens + 1, device=attention_mask.device)


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
    probs = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def check_generate_args(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                        temperature: float, top_p: float) -> None:
    """A clear error for a generation request no decoder can run."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ModelInputError(f"generate: input_ids {tuple(input_ids.shape)} and attention_mask "
                              f"{tuple(attention_mask.shape)} must both be [batch, prompt_len]")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    _check_sampling_args(temperature, top_p)


def decode_loop(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sampled: torch.Tensor,
                position: torch.Tensor, max_new_tokens: int, eos_ids: torch.Tensor | None, pad_token_id: int,
                check_every: int = 1,
                compact: Callable[[torch.Tensor, int], torch.Tensor | None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode loop: ``[B, max_new_tokens]`` responses and their mask.

    ``sampled`` ``[B]``: the tokens picked from the prompts' last logits; ``position`` ``[B, 1]``:
    where the first of them sits. ``step(tokens, position)`` feeds the batch's tokens and returns the
    next ones. Every ``check_every`` tokens (the loop's only host synchronisation) the loop stops if
    every row has finished, else ``compact(finished, unfinished)`` may return the rows the decoder
    kept (it has dropped the others from its own state), and the loop keeps the same ones.
    """
    batch, device = sampled.shape[0], sampled.device
    position = position.contiguous()  # one layout for every step (a compiled step guards on strides)
    responses = torch.full((max_new_tokens, batch), pad_token_id, dtype=sampled.dtype, device=device)
    response_mask = torch.zeros((max_new_tokens, batch), dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        if i % TOKEN_BLOCK == 0:
            progress.advance("tokens")
        responses[i].index_copy_(0, rows, torch.where(finished, torch.full_like(sampled, pad_token_id), sampled))
        response_mask[i].index_copy_(0, rows, (~finished).long())
        if i + 1 == max_new_tokens:
            break
        if eos_ids is not None:
            finished = finished | torch.isin(sampled, eos_ids)
            if (i + 1) % check_every == 0:
                unfinished = int((~finished).sum())
                if unfinished == 0:
                    break
                keep = None if compact is None else compact(finished, unfinished)
                if keep is not None:
                    rows, finished, position, sampled = rows[keep], finished[keep], position[keep], sampled[keep]
        # Finished rows are fed their sampled token, not the pad id: their logits are ignored,
        # and a pad id need not be a valid embedding index.
        sampled = step(sampled, position)
        position = position + 1
    return responses.t(), response_mask.t()


def generation_output(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_pos: torch.Tensor,
                      response_pos: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                      engine_stats: dict | None = None) -> GenerationOutput:
    """The :class:`GenerationOutput` of :func:`decode_loop`'s responses for these prompts."""
    mask_dtype = attention_mask.dtype
    return GenerationOutput(
        sequences=torch.cat([input_ids, responses], dim=1),
        responses=responses.contiguous(),
        response_mask=response_mask.to(mask_dtype),
        attention_mask=torch.cat([attention_mask.long(), response_mask], dim=1).to(mask_dtype),
        position_ids=torch.cat([prompt_pos, response_pos], dim=1),
        engine_stats=engine_stats,
    )


def cache_keyword(model: nn.Module) -> str:
    """The name a model's forward takes its KV cache by, and its output returns it by: ``cache``
    where the forward has that parameter (transformers 5 renamed ``past_key_values``, which it
    reads only until its deprecation ends), else ``past_key_values`` (earlier transformers,
    :class:`~resilient_rl.models.tiny.TinyCausalLM`)."""
    forward = getattr(model, "_orig_mod", model).forward  # a compiled model's own forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class _PlainDecoder:
    """:func:`generate`'s decoder: the model's own cache (or none), the growing sequence."""

    def __init__(self, model: nn.Module, input_ids, prompt_mask, prompt_pos, use_cache: bool, sample):
        self.model, self.use_cache, self.sample = model, use_cache, sample
        self.seq, self.seq_mask, self.seq_pos = input_ids, prompt_mask, prompt_pos
        self.past: Any = None
        self.cache_key = cache_keyword(model)

    def forward(self) -> torch.Tensor:
        """The sequence so far through the model: the next tokens."""
        if self.use_cache and self.past is not None:
            out = self.model(input_ids=self.seq[:, -1:], attention_mask=self.seq_mask,
                             position_ids=self.seq_pos[:, -1:], use_cache=True, **{self.cache_key: self.past})
        else:
            out = self.model(input_ids=self.seq, attention_mask=self.seq_mask, position_ids=self.seq_pos,
                             use_cache=self.use_cache)
        if self.use_cache:
            self.past = getattr(out, self.cache_key)
        return self.sample(out.logits[:, -1, :]).to(self.seq.dtype)

    def step(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # While generating, every generated token is attended to: a finished row's later tokens
        # are padding whose logits are ignored, so they need no masking until the final mask.
        self.seq = torch.cat([self.seq, tokens[:, None]], dim=1)
        self.seq_mask = torch.cat([self.seq_mask, torch.ones_like(self.seq_mask[:, :1])], dim=1)
        self.seq_pos = torch.cat([self.seq_pos, position], dim=1)
        return self.forward()


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
    """Generate ``max_new_tokens`` tokens for a batch of left-padded prompts (the plain mode).

    ``model`` is called with the Hugging Face convention (``input_ids``, ``attention_mask``,
    ``position_ids``, ``past_key_values`` or ``cache``: :func:`cache_keyword`, ``use_cache``) and
    must return an object with ``.logits`` and the cache by the same name; both
    :class:`~resilient_rl.models.tiny.TinyCausalLM` and Hugging Face causal LMs do.
    ``eos_token_id`` may be one id or several. Generation stops early once every row has produced
    an eos token; the remaining columns are ``pad_token_id``.
    """
    check_generate_args(input_ids, attention_mask, max_new_tokens, temperature, top_p)
    prompt_mask = attention_mask.long()
    prompt_pos, response_pos = generation_positions(prompt_mask, max_new_tokens)
    decoder = _PlainDecoder(model, input_ids, prompt_mask, prompt_pos, use_cache,
                            lambda logits: sample_next_token(logits, temperature, top_p, generator))
    responses, response_mask = decode_loop(decoder.step, decoder.forward(), response_pos[:, :1], max_new_tokens,
                                           _eos_tensor(eos_token_id, input_ids.device), pad_token_id)
    return generation_output(input_ids, attention_mask, prompt_pos, response_pos, responses, response_mask)


def _check_sampling_args(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ConfigError(f"generate: temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"generate: top_p must be in (0, 1], got {top_p!r}")


def _eos_tensor(eos_token_id: int | Sequence[int] | torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids:
        return None
    return torch.tensor(ids, dtype=torch.long, device=device)
