"""The rollout engine's fast path: static KV cache, shared prefill, decode without host syncs.

:func:`generate_static` has the contract of :func:`~resilient_rl.models.generation.generate`
(left-padded prompts in, a :class:`GenerationOutput` with exactly ``max_new_tokens`` response
columns out) and differs in how it gets there:

- **Preallocated cache.** Keys and values live in buffers of ``prompt_len + max_new_tokens``
  columns, allocated once and written in place (:mod:`resilient_rl.models.kv_cache`); nothing
  grows by concatenation, so every decode step has the same shapes.
- **One prefill per prompt.** Adjacent identical rows (a prompt repeated for its ``rollout.n``
  samples) are prefilled once; the cache rows and the first logits are then repeated.
- **No host synchronisation inside decode.** Sampling stays on the device
  (:mod:`resilient_rl.models.sampling`); whether every row has finished is read back only once
  every ``check_every`` tokens.
- **Finished rows leave the batch.** At a check, when at least ``compact_min_fraction`` of the rows
  in the batch have finished, they are dropped from the batch and the cache (on CUDA the batch is
  kept at a multiple of :data:`CUDA_ROW_BUCKET`, so captured graphs are reused).
- **CUDA graphs.** On a CUDA device with ``cuda_graphs``, the decode step is compiled with
  ``torch.compile(mode="reduce-overhead")``, which captures it in a CUDA graph per batch size.

Random stream: a seeded generator reproduces the same tokens bit for bit (what a replayed step
after recovery relies on), but it is a different stream from the plain path's: a draw inverts
the cumulative distribution with one uniform number per row instead of calling ``multinomial``,
and rows that finished are not sampled once they left the batch. Greedy decoding
(``temperature == 0``) picks the same tokens as the plain path up to floating-point ties.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from resilient_rl.runtime import progress
from resilient_rl.errors import ConfigError, ModelInputError
from resilient_rl.models.generation import (
    TOKEN_BLOCK,
    GenerationOutput,
    _check_sampling_args,
    _eos_tensor,
    compute_position_ids,
)
from resilient_rl.models.kv_cache import StaticKVCache, select_cache_rows
from resilient_rl.models.sampling import sample_tokens
from resilient_rl.models.tiny import TinyCausalLM

__all__ = ["CUDA_ROW_BUCKET", "ENGINES", "compaction_rows", "generate_static", "graphed", "resolve_engine",
           "shared_prompt_groups", "static_unsupported_reason"]

log = logging.getLogger(__name__)

#: Values of ``rollout.engine``.
ENGINES = ("auto", "static", "plain")
#: On CUDA a compacted batch keeps a multiple of this many rows: one captured graph per bucket.
CUDA_ROW_BUCKET = 8


def static_unsupported_reason(model: nn.Module) -> str | None:
    """Why the static engine cannot run ``model`` (None when it can)."""
    if isinstance(model, TinyCausalLM):
        return None if model.lm_head is not None else "the tiny model has no lm_head"
    if hasattr(model, "config") and hasattr(model, "get_output_embeddings"):
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not support transformers' StaticCache"
        return None
    return f"{type(model).__name__} is neither the built-in tiny model nor a Hugging Face causal LM"


def resolve_engine(choice: str, model: nn.Module) -> str:
    """``rollout.engine`` to the engine that runs: ``auto`` is ``static`` where supported."""
    if choice not in ENGINES:
        raise ConfigError(f"rollout.engine={choice!r}: allowed values are {', '.join(ENGINES)}")
    if choice == "plain":
        return "plain"
    reason = static_unsupported_reason(model)
    if reason is None:
        return "static"
    if choice == "static":
        raise ConfigError(f"rollout.engine='static' cannot run this model: {reason}; use 'auto' or 'plain'")
    return "plain"


def shared_prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group, first)``: adjacent identical rows form a group; ``first`` ``[U]`` holds the first
    row of each group and ``group`` ``[B]`` the group of each row (so ``first[group]`` maps every
    row to a representative with the same prompt)."""
    same = (input_ids[1:] == input_ids[:-1]).all(dim=1) & (attention_mask[1:] == attention_mask[:-1]).all(dim=1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=input_ids.device), ~same])
    return starts.long().cumsum(0) - 1, starts.nonzero().squeeze(1)


def compaction_rows(finished: torch.Tensor, unfinished: int, min_fraction: float,
                    multiple: int = 1) -> torch.Tensor | None:
    """Rows to keep (ascending, every unfinished row first in line) or None when compaction does not
    pay: the batch shrinks to ``unfinished`` rounded up to ``multiple`` (padded with finished rows,
    which keep decoding harmlessly), and only if that drops at least ``min_fraction`` of it."""
    current = finished.shape[0]
    size = min(current, -(-unfinished // multiple) * multiple)
    if current - size < max(1, min_fraction * current):
        return None
    order = torch.argsort(finished.to(torch.int8), stable=True)
    return order[:size].sort().values


class _TinyBackend:
    """The built-in tiny model over a :class:`StaticKVCache`."""

    def __init__(self, model: TinyCausalLM):
        self.model = model
        self.cache: StaticKVCache | None = None

    def check_positions(self, last_position: int) -> None:
        limit = self.model.config.max_seq_len
        if last_position >= limit:
            raise ConfigError(f"position {last_position} is past model.max_seq_len={limit}; "
                              "raise model.max_seq_len to cover prompt + response length")

    def prefill(self, input_ids, position_ids, prompt_mask, total_len: int) -> torch.Tensor:
        cfg, batch, prompt_len = self.model.config, *input_ids.shape
        weight = self.model.embed_tokens.weight
        self.cache = StaticKVCache.allocate(cfg.num_layers, batch, cfg.num_heads, total_len,
                                            cfg.hidden_size // cfg.num_heads, weight.dtype, weight.device)
        idx = torch.arange(total_len, device=input_ids.device)
        query = idx[:prompt_len]
        allowed = (idx[None, :] <= query[:, None]) & (idx[None, :] < prompt_len)
        mask = allowed[None] & torch.nn.functional.pad(prompt_mask.bool(), (0, total_len - prompt_len))[:, None, :]
        mask = mask | (idx[None, :] == query[:, None])[None]
        return self.model.forward_static(input_ids, position_ids, self.cache, mask[:, None], query)

    def decode_inputs(self) -> tuple:
        return (self.model, self.cache)

    @staticmethod
    def decode(model, cache, tokens, position_ids, column, key_valid) -> torch.Tensor:
        """One decode step; a plain function of its inputs (the model and the cache among them), so
        one compiled version serves every call and its captured graphs are reused."""
        return model.forward_static(tokens[:, None], position_ids, cache, key_valid[:, None, None, :], column)

    def select(self, index: torch.Tensor) -> None:
        self.cache.select_rows(index)


class _HFBackend:
    """A Hugging Face causal LM over transformers' ``StaticCache``."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache = None
        # transformers renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away).
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def check_positions(self, last_position: int) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and last_position >= limit:
            raise ConfigError(f"position {last_position} is past the model's max_position_embeddings={limit}; "
                              "shorten data.max_prompt_length or rollout.max_new_tokens")

    def prefill(self, input_ids, position_ids, prompt_mask, total_len: int) -> torch.Tensor:
        from transformers import StaticCache

        self.cache = StaticCache(config=self.model.config, max_cache_len=total_len)
        out = self.model(input_ids=input_ids, attention_mask=prompt_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache},
                         cache_position=torch.arange(input_ids.shape[1], device=input_ids.device))
        return out.logits[:, -1]

    def decode_inputs(self) -> tuple:
        return (self.model, {self.cache_arg: self.cache})

    @staticmethod
    def decode(model, cache_kwargs, tokens, position_ids, column, key_valid) -> torch.Tensor:
        """One decode step (see :meth:`_TinyBackend.decode`)."""
        out = model(input_ids=tokens[:, None], attention_mask=key_valid.long(), position_ids=position_ids,
                    use_cache=True, cache_position=column, **cache_kwargs)
        return out.logits[:, -1]

    def select(self, index: torch.Tensor) -> None:
        select_cache_rows(self.cache, index)


_GRAPHED: dict[Callable, Callable] = {}


def graphed_once(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """:func:`graphed` ``fn``, made once per process: compiled code and captured graphs outlive a
    single generation call."""
    if fn not in _GRAPHED:
        _GRAPHED[fn] = graphed(fn)
    return _GRAPHED[fn]


def graphed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` compiled with ``torch.compile(mode="reduce-overhead")`` (captured in a CUDA graph per
    input shape), falling back to ``fn`` itself, with a warning, if compiling fails: a model the
    compiler cannot handle still generates. A failed call may be repeated eagerly because a decode
    step only overwrites one cache column and returns logits."""
    compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False)
    chosen = [compiled]

    def call(*args):
        try:
            return chosen[0](*args)
        except Exception as exc:  # noqa: BLE001 -- any compiler failure: the eager step is correct too
            if chosen[0] is fn:
                raise
            log.warning("rollout engine: compiling the decode step failed (%s: %s); decoding eagerly",
                        type(exc).__name__, exc)
            chosen[0] = fn
            return fn(*args)

    return call


@torch.no_grad()
def generate_static(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | torch.Tensor | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    check_every: int = 8,
    compact_min_fraction: float = 0.25,
    cuda_graphs: bool = True,
) -> GenerationOutput:
    """Generate ``max_new_tokens`` tokens per left-padded prompt (see the module docstring).

    ``eos_token_id`` may be one id, several ids (list or tensor) or None; a row ends at the first
    of them. ``check_every``: tokens between the finish checks (the only host synchronisations).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ModelInputError(f"generate: input_ids {tuple(input_ids.shape)} and attention_mask "
                              f"{tuple(attention_mask.shape)} must both be [batch, prompt_len]")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(check_every, int) or check_every < 1:
        raise ConfigError(f"rollout.finish_check_every must be a positive int, got {check_every!r}")
    if not 0 <= compact_min_fraction <= 1:
        raise ConfigError(f"rollout.compact_min_fraction must be in [0, 1], got {compact_min_fraction!r}")
    _check_sampling_args(temperature, top_p)
    reason = static_unsupported_reason(model)
    if reason is not None:
        raise ConfigError(f"rollout.engine='static' cannot run this model: {reason}")
    backend = _TinyBackend(model) if isinstance(model, TinyCausalLM) else _HFBackend(model)

    batch, prompt_len = input_ids.shape
    device = input_ids.device
    total_len = prompt_len + max_new_tokens
    prompt_mask = attention_mask.long()
    prompt_pos = compute_position_ids(prompt_mask)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, max_new_tokens + 1, device=device)
    backend.check_positions(int(response_pos.max()))
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    eos_ids = _eos_tensor(eos_token_id, device)

    group, first = shared_prompt_groups(input_ids, prompt_mask)
    logits = backend.prefill(input_ids[first], prompt_pos[first], prompt_mask[first], total_len)
    if first.shape[0] != batch:
        backend.select(group)
        logits = logits.index_select(0, group)

    decode = type(backend).decode
    on_cuda = device.type == "cuda"
    if on_cuda and cuda_graphs:
        decode = graphed_once(decode)
    bucket = CUDA_ROW_BUCKET if on_cuda else 1

    responses = torch.full((max_new_tokens, batch), pad_token_id, dtype=input_ids.dtype, device=device)
    response_mask = torch.zeros((max_new_tokens, batch), dtype=torch.long, device=device)
    key_valid = torch.zeros((batch, total_len), dtype=torch.bool, device=device)
    key_valid[:, :prompt_len] = prompt_mask.bool()
    rows = torch.arange(batch, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    position = response_pos[:, :1].clone()
    column = torch.full((1,), prompt_len, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if step % TOKEN_BLOCK == 0:
            progress.advance("tokens")
        sampled = sample_tokens(logits, temperature, top_p, generator).to(input_ids.dtype)
        responses[step].index_copy_(0, rows, torch.where(finished, torch.full_like(sampled, pad_token_id), sampled))
        response_mask[step].index_copy_(0, rows, (~finished).long())
        if step + 1 == max_new_tokens:
            break
        if eos_ids is not None:
            finished = finished | torch.isin(sampled, eos_ids)
            if (step + 1) % check_every == 0:
                unfinished = int((~finished).sum())  # the loop's only host synchronisation
                if unfinished == 0:
                    break
                keep = compaction_rows(finished, unfinished, compact_min_fraction, bucket)
                if keep is not None:
                    backend.select(keep)
                    rows, finished, key_valid = rows[keep], finished[keep], key_valid[keep]
                    position, sampled = position[keep], sampled[keep]
        # Finished rows are fed their sampled token, not the pad id: their logits are ignored,
        # and a pad id need not be a valid embedding index.
        key_valid.index_fill_(1, column, True)
        logits = decode(*backend.decode_inputs(), sampled, position, column, key_valid)
        position = position + 1
        column = column + 1

    responses, response_mask = responses.t(), response_mask.t()
    mask_dtype = attention_mask.dtype
    return GenerationOutput(
        sequences=torch.cat([input_ids, responses], dim=1),
        responses=responses.contiguous(),
        response_mask=response_mask.to(mask_dtype),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1).to(mask_dtype),
        position_ids=torch.cat([prompt_pos, response_pos], dim=1),
    )
