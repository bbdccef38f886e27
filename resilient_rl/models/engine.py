"""The rollout engine's fast path: a kept KV cache, shared prefill, decode without host syncs.

:func:`generate_static` has the contract of :func:`~resilient_rl.models.generation.generate`
(left-padded prompts in, a :class:`GenerationOutput` with exactly ``max_new_tokens`` response
columns out) and runs the same decode loop
(:func:`~resilient_rl.models.generation.decode_loop`) with a decoder of its own, which differs
from the plain mode's in how it gets there:

- **Kept cache.** Keys and values live in buffers allocated once per model and kept across
  rollouts (:mod:`resilient_rl.models.kv_cache`), written in place; nothing grows by
  concatenation, so every decode step of a batch size has the same shapes and addresses.
- **Attention that reads each K/V once, up to the current column.** Decode attends with
  grouped-query heads in one grouped matrix product over the cache, no ``repeat_kv``
  (:mod:`resilient_rl.models.cache_attention`), for the tiny model and Hugging Face models alike.
  A step reads the cache's columns up to its own, rounded up to a multiple of ``BLOCK`` (128), or
  of a larger multiple of it where the cache holds more than :data:`SPANS` blocks: the span is a
  symbol of the compiled step, so a generation of 512 new tokens after a 256-token prompt reads
  384, then 512, 640 and 768 columns instead of 768 at every step, with one compile.
- **One prefill per prompt.** Adjacent identical rows (a prompt repeated for its ``rollout.n``
  samples) are prefilled once; the cache rows and the first logits are then repeated.
- **No host synchronisation inside decode.** Sampling stays on the device, inside the decode step
  (:mod:`resilient_rl.models.sampling`); whether every row has finished is read back only once
  every ``check_every`` tokens.
- **Finished rows leave the batch, in buckets.** At a check, the batch shrinks to the smallest of a
  few fixed sizes (:func:`~resilient_rl.models.decode_step.row_buckets`) that holds the unfinished
  rows, when that drops at least ``compact_min_fraction`` of it: one compile serves every bucket
  (the batch is a symbol of the compiled step), with one CUDA graph per bucket and span.
- **Fewer, larger products.** A rollout model's query, key and value projections run as one
  matrix product, and its MLP's gate and up projections as another
  (:mod:`resilient_rl.models.fused_projections`, for the Llama family): four products a layer
  instead of seven.
- **Compiled step.** With ``compile`` (default: on a CUDA device) the decode step runs through
  ``torch.compile``; on CUDA with ``cuda_graphs`` it is captured in a CUDA graph per bucket and
  span (:mod:`resilient_rl.models.decode_step`, which also counts compiles and graph breaks).

Random stream: a seeded generator reproduces the same tokens bit for bit (what a replayed step
after recovery relies on), but it is a different stream from the plain path's: a draw inverts
the cumulative distribution with one uniform number per row instead of calling ``multinomial``,
and rows that finished are not sampled once they left the batch. Greedy decoding
(``temperature == 0``) picks the same tokens as the plain path up to floating-point ties.
"""

from __future__ import annotations

import importlib
import time
import weakref
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from resilient_rl.errors import ConfigError
from resilient_rl.models.cache_attention import BLOCK, EngineStep, engine_attention
from resilient_rl.models.decode_kept import step_key
from resilient_rl.models.decode_step import DecodeStep, row_buckets
from resilient_rl.models.fused_projections import refuse
from resilient_rl.models.generation import (
    GenerationOutput,
    _eos_tensor,
    check_generate_args,
    decode_loop,
    generation_output,
    generation_positions,
)
from resilient_rl.models.kv_cache import PAD_COLUMNS, CacheShape, EngineCache
from resilient_rl.models.sampling import draw_uniform, sample_tokens
from resilient_rl.models.tiny import TinyCausalLM, attention_mask_4d

__all__ = ["CUDA_ROW_BUCKET", "ENGINES", "compaction_rows", "compiles_decode", "engine_cache", "generate_static",
           "import_compiler_code", "resolve_engine", "shared_prompt_groups", "static_unsupported_reason"]


#: Values of ``rollout.engine``.
ENGINES = ("auto", "static", "plain")
#: On CUDA no bucket is smaller than this many rows (and buckets are multiples of it).
CUDA_ROW_BUCKET = 8
#: A decode step reads the cache's columns up to its own in at most this many spans (see _EngineDecoder.views).
SPANS = 8


def static_unsupported_reason(model: nn.Module) -> str | None:
    """Why the static engine cannot run ``model`` (None when it can)."""
    if isinstance(model, TinyCausalLM):
        return None if model.lm_head is not None else "the tiny model has no lm_head"
    if hasattr(model, "config") and hasattr(model, "get_output_embeddings"):
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not support transformers' static shapes"
        config = model.config
        if getattr(config, "use_sliding_window", False) or getattr(config, "attn_logit_softcapping", None):
            return f"{type(model).__name__} uses sliding-window or soft-capped attention"
        if model.get_output_embeddings() is None:
            return f"{type(model).__name__} has no output embeddings"
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
                    buckets: Sequence[int] | None = None) -> torch.Tensor | None:
    """Rows to keep (ascending, every unfinished row first in line) or None when compaction does not
    pay: the batch shrinks to the smallest of ``buckets`` that holds ``unfinished`` rows (any size
    when None), padded with finished rows, which keep decoding harmlessly, and only if that drops
    at least ``min_fraction`` of it."""
    current = finished.shape[0]
    size = min([b for b in (buckets or [unfinished]) if b >= unfinished] + [current])
    if current - size < max(1, min_fraction * current):
        return None
    order = torch.argsort(finished.to(torch.int8), stable=True)
    return order[:size].sort().values


def _tiny_shape(model: TinyCausalLM) -> CacheShape:
    cfg, weight = model.config, model.embed_tokens.weight
    return CacheShape(cfg.num_layers, cfg.num_heads, cfg.hidden_size // cfg.num_heads, weight.dtype, weight.device)


def _tiny_forward(model: TinyCausalLM, input_ids, position_ids, step: EngineStep) -> torch.Tensor:
    return model.forward_static(input_ids, position_ids, step)


def _tiny_limit(model: TinyCausalLM) -> tuple[int, str]:
    return model.config.max_seq_len, ("model.max_seq_len={limit}; raise model.max_seq_len to cover prompt + "
                                      "response length")


def _hf_shape(model: nn.Module) -> CacheShape:
    config, weight = model.config, model.get_output_embeddings().weight
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return CacheShape(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                      weight.dtype, weight.device)


def _hf_forward(model: nn.Module, input_ids, position_ids, step: EngineStep) -> torch.Tensor:
    """A Hugging Face model's forward with its attention through the engine's cache
    (:mod:`resilient_rl.models.cache_attention`); the model's own cache is not used."""
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1,
                rrl_engine_step=step)
    return out.logits[:, -1]


def _hf_limit(model: nn.Module) -> tuple[int | None, str]:
    return getattr(model.config, "max_position_embeddings", None), (
        "the model's max_position_embeddings={limit}; shorten data.max_prompt_length or rollout.max_new_tokens")


_CACHES: "weakref.WeakKeyDictionary[nn.Module, EngineCache]" = weakref.WeakKeyDictionary()


def compiles_decode(compile: bool | None, device: torch.device | str) -> bool:
    """Whether :func:`generate_static` compiles its decode step: ``compile``, or, when None, on CUDA."""
    return torch.device(device).type == "cuda" if compile is None else bool(compile)


#: What the first compile or load of the decode step imports (inductor, and the modules its
#: generated code imports): about a second on a CPU core.
_COMPILER_MODULES = ("torch._inductor.compile_fx", "torch._inductor.select_algorithm",
                     "torch._inductor.codegen.wrapper", "torch._inductor.codegen.memory_planning")


def import_compiler_code(device: torch.device | str) -> None:
    """Import what the first compile or load of the decode step on ``device`` will: inductor's
    modules; on a GPU Triton's kernel launcher too, and on a CPU the probe of the vector
    instructions inductor's C++ may use (it builds and runs a test program once per process, about
    1.5 s here). Initialises no device."""
    kind = torch.device(device).type
    for name in _COMPILER_MODULES + (("torch._inductor.runtime.triton_heuristics",) if kind == "cuda" else ()):
        importlib.import_module(name)
    if kind == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()


def engine_cache(model: nn.Module, shape: CacheShape, rows: int, columns: int) -> EngineCache:
    """The model's cache, kept from one generation to the next (grown when this one needs more)."""
    cache = _CACHES.get(model)
    if cache is None or not cache.fits(shape, rows, columns):
        old = cache.capacity if cache is not None and cache.shape == shape else (0, 0)
        _CACHES.pop(model, None)
        del cache  # the old buffers go before the new ones are allocated
        cache = EngineCache(shape, max(rows, old[0]), max(columns, old[1]))
        _CACHES[model] = cache
    return cache


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
    compile: bool | None = None,
) -> GenerationOutput:
    """Generate ``max_new_tokens`` tokens per left-padded prompt (see the module docstring).

    ``eos_token_id`` may be one id, several ids (list or tensor) or None; a row ends at the first
    of them. ``check_every``: tokens between the finish checks (the only host synchronisations).
    ``compile``: run the decode step through ``torch.compile`` (None: on a CUDA device only).
    """
    check_generate_args(input_ids, attention_mask, max_new_tokens, temperature, top_p)
    if not isinstance(check_every, int) or check_every < 1:
        raise ConfigError(f"rollout.finish_check_every must be a positive int, got {check_every!r}")
    if not 0 <= compact_min_fraction <= 1:
        raise ConfigError(f"rollout.compact_min_fraction must be in [0, 1], got {compact_min_fraction!r}")
    reason = static_unsupported_reason(model)
    if reason is not None:
        raise ConfigError(f"rollout.engine='static' cannot run this model: {reason}")
    refuse(model)  # fused projections cut off from their parameters (replaced, or copied by a .to) fused again
    tiny = isinstance(model, TinyCausalLM)
    forward, shape_of, limit_of = (_tiny_forward, _tiny_shape, _tiny_limit) if tiny else \
        (_hf_forward, _hf_shape, _hf_limit)

    batch, prompt_len = input_ids.shape
    device = input_ids.device
    total_len = prompt_len + max_new_tokens
    prompt_mask = attention_mask.long()
    prompt_pos, response_pos = generation_positions(prompt_mask, max_new_tokens)
    limit, hint = limit_of(model)
    last = int(response_pos.max())
    if limit is not None and last >= limit:
        raise ConfigError(f"position {last} is past " + hint.format(limit=limit))
    eos_ids = _eos_tensor(eos_token_id, device)

    on_cuda = device.type == "cuda"
    compiling = compiles_decode(compile, device)
    step_fn = DecodeStep(compile=compiling, cuda_graphs=on_cuda and cuda_graphs,
                         key=step_key(model) if compiling else None)
    # Buckets depend on the device only: compiled or not, a seeded generation samples the same rows.
    buckets = row_buckets(batch, CUDA_ROW_BUCKET if on_cuda and batch >= CUDA_ROW_BUCKET else 1)
    cache = engine_cache(model, shape_of(model), batch, -(-total_len // BLOCK) * BLOCK)

    started = time.perf_counter()
    group, first = shared_prompt_groups(input_ids, prompt_mask)
    cache.rows = int(first.shape[0])
    keys, values = cache.views()
    prefill = EngineStep(keys, values, torch.arange(prompt_len, device=device),
                         prefill_mask=attention_mask_4d(prompt_mask[first], 0, prompt_mask.shape[1]))
    with nullcontext() if tiny else engine_attention(model):
        logits = forward(model, input_ids[first], prompt_pos[first], prefill)
        if first.shape[0] != batch:  # the samples of a prompt take copies of its prefilled rows
            cache.take_rows(group)
            logits = logits.index_select(0, group)
        decoder = _EngineDecoder(step_fn, forward, model, cache, prompt_mask, temperature, top_p, generator,
                                 compact_min_fraction, buckets)
        first_tokens = sample_tokens(logits, temperature, top_p, generator).to(input_ids.dtype)
        step_fn.stats.prefill_s = _synchronized_since(started, device)
        started = time.perf_counter()
        responses, response_mask = decode_loop(decoder.step, first_tokens, response_pos[:, :1], max_new_tokens, eos_ids,
                                               pad_token_id, check_every, decoder.compact)
        step_fn.stats.loop_s = _synchronized_since(started, device)
    return generation_output(input_ids, attention_mask, prompt_pos, response_pos, responses, response_mask,
                             step_fn.finish())


def _synchronized_since(started: float, device: torch.device) -> float:
    """Seconds since ``started`` (``time.perf_counter``), once ``device`` has done its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


class _EngineDecoder:
    """:func:`generate_static`'s decoder: the kept cache, the compiled step, compaction in buckets."""

    def __init__(self, step_fn: DecodeStep, forward, model: nn.Module, cache: EngineCache, prompt_mask, temperature,
                 top_p, generator, compact_min_fraction, buckets):
        self.step_fn, self.forward, self.model, self.cache = step_fn, forward, model, cache
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.compact_min_fraction, self.buckets = compact_min_fraction, buckets
        batch, prompt_len = prompt_mask.shape
        # As the cache's buffers, one column wider than used: its views are never contiguous.
        self.key_valid = torch.zeros((batch, cache.capacity[1] + PAD_COLUMNS), dtype=torch.bool,
                                     device=prompt_mask.device)
        self.key_valid[:, :prompt_len] = prompt_mask.bool()
        self.column = torch.full((1,), prompt_len, dtype=torch.long, device=prompt_mask.device)
        self.next_column = prompt_len  # the host's count of ``column``: no synchronisation to read it
        self.span = 0  # the cache columns the views below cover (0: none taken yet)
        # Spans grow by a multiple of BLOCK columns, at most SPANS of them over the cache.
        self.span_step = BLOCK * -(-cache.capacity[1] // (SPANS * BLOCK))

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Keys, values and key mask of the columns the step at ``next_column`` reads: every column
        up to its own, rounded up to a multiple of ``span_step`` (at most :data:`SPANS` spans, each
        a value of one symbol of the compiled step; on a GPU a CUDA graph per span and bucket)."""
        span = min(self.cache.capacity[1], (self.next_column // self.span_step + 1) * self.span_step)
        if span != self.span:
            self.keys, self.values = self.cache.views(columns=span)
            self.valid_span = self.key_valid[:, :span]
            self.span = span
        return self.keys, self.values, self.valid_span

    def step(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.key_valid.index_fill_(1, self.column, True)
        keys, values, key_valid = self.views()
        draw = draw_uniform(tokens.shape[0], self.temperature, self.generator, tokens.device)
        picked = self.step_fn(self.forward, self.model, keys, values, tokens, position, self.column,
                              key_valid, draw, self.temperature, self.top_p).to(tokens.dtype)
        self.column = self.column + 1
        self.next_column += 1
        return picked

    def compact(self, finished: torch.Tensor, unfinished: int) -> torch.Tensor | None:
        keep = compaction_rows(finished, unfinished, self.compact_min_fraction, self.buckets)
        if keep is not None:
            self.cache.take_rows(keep)
            self.key_valid = self.key_valid[keep]
            self.span = 0  # the views hold the rows before the compaction
            self.step_fn.stats.compactions += 1
        return keep
