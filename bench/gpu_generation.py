"""Generation on the GPU for bench/gpu.py's workloads: the rollout engine vs Hugging Face ``generate``.

The workload's model (config-built, random weights) in bf16 on the GPU and one batch of its shape
(``prompts`` left-padded prompts of ``prompt_len`` columns x ``n`` samples, ``max_new_tokens`` each,
no eos so every path generates the same tokens), through the project's engine
(:func:`resilient_rl.models.engine.generate_static`, decode step in a CUDA graph), HF ``generate``
with its default (dynamic) cache and with ``cache_implementation="static"``. Each path runs once to
warm up (compilation, graph capture) and is then timed once, synchronised.
"""

from __future__ import annotations

import time

import torch

from gpu_workloads import Workload, decode_roofline_tokens_per_s, device_specs


def _timed(fn) -> float:
    fn()  # warm-up: compilation and CUDA graph capture are not generation
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


#: The generation paths compared, in order (the engine first: the others are ratios against it).
PATHS = ("engine", "hf_dynamic", "hf_static")


def compare_generation(w: Workload, dtype: torch.dtype = torch.bfloat16,
                       paths: tuple[str, ...] = PATHS) -> dict[str, float]:
    """Seconds per path for workload ``w``'s batch (see the module docstring)."""
    import transformers

    from generation import make_batch  # bench/generation.py
    from resilient_rl.models.engine import generate_static

    config = transformers.AutoConfig.for_model(**w.hf_config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids, mask = (t.cuda() for t in make_batch(config.vocab_size, w.prompts, w.prompt_len))
    rep_ids, rep_mask = ids.repeat_interleave(w.n, 0), mask.repeat_interleave(w.n, 0)

    def engine():
        generate_static(model, rep_ids, rep_mask, max_new_tokens=w.max_new_tokens, temperature=1.0,
                        generator=torch.Generator(device="cuda").manual_seed(1))

    def hf(cache: str | None):
        def run():
            extra = {"cache_implementation": cache} if cache else {}
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                               top_k=0, max_new_tokens=w.max_new_tokens, min_new_tokens=w.max_new_tokens,
                               num_return_sequences=w.n, **extra)
        return run

    runs = {"engine": engine, "hf_dynamic": hf(None), "hf_static": hf("static")}
    seconds = {name: _timed(runs[name]) for name in paths}
    seconds["param_bytes"] = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    return seconds


def generation_lines(w: Workload, seconds: dict[str, float], device_name: str, dtype_bytes: int = 2) -> list[str]:
    """The printed figures: output tokens/s per path, ratios, and the engine's share of the roofline."""
    rows = w.prompts * w.n
    tokens = rows * w.max_new_tokens
    lines = [f"generation, {w.prompts} prompts x n={w.n} = {rows} rows, prompt {w.prompt_len}, "
             f"{w.max_new_tokens} new tokens each ({tokens} output tokens):"]
    for name in (p for p in PATHS if p in seconds):
        ratio = "" if name == "engine" else f"   engine is {seconds[name] / seconds['engine']:.2f}x faster"
        lines.append(f"  {name:<11}{seconds[name]:8.2f} s  {tokens / seconds[name]:9.0f} output tokens/s{ratio}")
    specs = device_specs(device_name)
    if specs is None:
        lines.append(f"  decode roofline: n/a (no memory bandwidth known for {device_name!r})")
    else:
        bound = decode_roofline_tokens_per_s(seconds["param_bytes"], w.kv_bytes_per_token(dtype_bytes), rows,
                                             w.prompt_len, w.max_new_tokens, specs[1])
        lines.append(f"  decode roofline at {specs[1] / 1e12:.2f} TB/s: {bound:.0f} output tokens/s; "
                     f"engine reaches {100 * tokens / seconds['engine'] / bound:.1f}% of it")
    return lines
