"""Generation for bench/gpu.py's workloads: the rollout engine vs Hugging Face ``generate``.

The run's own rollout model, built as its rollout workers build it (the workload's config, random
weights, the rollout's precision) on the run's device, and one batch of the workload's shape
(``prompts`` left-padded prompts of ``prompt_len`` columns x ``n`` samples, ``max_new_tokens``
each, no eos so every path generates the same tokens), through the project's engine
(:func:`resilient_rl.models.engine.generate_static` with the run's rollout settings: its decode step
compiled, on a GPU in CUDA graphs), HF ``generate`` with its default (dynamic) cache and with
``cache_implementation="static"``.

The engine first loads the decode step the run's rollout kept (``<run>/compile_cache``,
:mod:`resilient_rl.workers.compile_cache`), as a rollout process the run starts later would: the
model's configuration is the run's, so the kept step's key matches and nothing is traced or
compiled again (on an H200 that compile took about 50 s of a 121 s comparison). The paths that
compile or capture (the engine, HF's static cache) run once to warm up and are then timed once;
HF's dynamic cache compiles nothing and is timed once (its 20 s warm-up measured nothing more).
Every timing is synchronised.
"""

from __future__ import annotations

import time

import torch

from decode_bench import synchronize
from gpu_workloads import Workload, decode_roofline_tokens_per_s, device_specs


def _seconds(fn) -> float:
    synchronize()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


#: The generation paths compared, in order (the engine first: the others are ratios against it).
PATHS = ("engine", "hf_dynamic", "hf_static")
#: The paths whose first call compiles or captures CUDA graphs: timed after one warm-up call.
WARMED = ("engine", "hf_static")


def worker_threads(cfg) -> int:
    """The intra-op threads of the run's rollout processes: one on a CPU (``workers/roles.py`` pins
    it), else what Ray gives a worker, ``OMP_NUM_THREADS`` where the local cluster inherits it from
    this process, or the floor of its CPUs (``ray.cpus_per_worker``), at least 1. The compiled step's
    guards check the thread count, so the comparison runs with the rollout's."""
    import math
    import os

    from resilient_rl.workers.fsdp import uses_cuda

    if not uses_cuda(cfg.trainer.device):
        return 1
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, math.floor(cfg.ray.cpus_per_worker)))


def rollout_model(cfg, vocab_size: int):
    """The run's rollout model, built as its rollout workers build it (``cfg``: the run's config,
    ``vocab_size``: its tokenizer's), with the decode step the run kept loaded into this process,
    which runs as many intra-op threads as the rollout's (:func:`worker_threads`) and its
    determinism setting."""
    from resilient_rl.workers.compile_cache import CompileCache
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.rollout import RolloutEngine

    from resilient_rl.workers.determinism import apply_deterministic

    torch.set_num_threads(worker_threads(cfg))  # the guards check these as the rollout processes set them
    apply_deterministic(cfg.trainer.deterministic)
    plan = plan_device(cfg.trainer.device, cfg.model.dtype)
    cache = CompileCache(cfg.checkpoint.root, cfg.trainer.run_name, cfg.checkpoint.storage_options)
    return RolloutEngine(cfg.model, cfg.rollout, vocab_size, cfg.trainer.seed, plan, eos_token_id=None,
                         pad_token_id=0, compile_cache=cache).model


def compare_generation(w: Workload, cfg, vocab_size: int, paths: tuple[str, ...] = PATHS) -> dict[str, float]:
    """Seconds per path for workload ``w``'s batch on the run's rollout model (see the module
    docstring), the engine's warm-up (``engine_warmup``) and its decode-step compiles
    (``engine_compiles``: 0 where the run's kept step served)."""
    from generation import make_batch  # bench/generation.py
    from resilient_rl.models.engine import generate_static

    model = rollout_model(cfg, vocab_size)
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids, mask = (t.to(device) for t in make_batch(model.config.vocab_size, w.prompts, w.prompt_len))
    rep_ids, rep_mask = ids.repeat_interleave(w.n, 0), mask.repeat_interleave(w.n, 0)
    r = cfg.rollout
    compiles = []

    def engine():  # the rollout's own call (workers/rollout.py), no eos
        out = generate_static(model, rep_ids, rep_mask, max_new_tokens=w.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, generator=torch.Generator(device=device).manual_seed(1),
                              check_every=r.finish_check_every, compact_min_fraction=r.compact_min_fraction,
                              cuda_graphs=r.cuda_graphs, compile=r.compile)
        compiles.append(out.engine_stats["compiles"] if out.engine_stats else 0)

    def hf(cache: str | None):
        def run():
            extra = {"cache_implementation": cache} if cache else {}
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=r.temperature,
                               top_p=r.top_p, top_k=0, max_new_tokens=w.max_new_tokens,
                               min_new_tokens=w.max_new_tokens, num_return_sequences=w.n, **extra)
        return run

    runs = {"engine": engine, "hf_dynamic": hf(None), "hf_static": hf("static")}
    seconds: dict[str, float] = {}
    for name in paths:
        if name in WARMED:
            seconds[f"{name}_warmup"] = _seconds(runs[name])
        seconds[name] = _seconds(runs[name])
    seconds["engine_compiles"] = float(sum(compiles))
    seconds["param_bytes"] = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    return seconds


def generation_lines(w: Workload, seconds: dict[str, float], device_name: str, dtype_bytes: int = 2) -> list[str]:
    """The printed figures: output tokens/s per path, ratios, the engine's warm-up and compiles,
    and the engine's share of the roofline."""
    rows = w.prompts * w.n
    tokens = rows * w.max_new_tokens
    lines = [f"generation, {w.prompts} prompts x n={w.n} = {rows} rows, prompt {w.prompt_len}, "
             f"{w.max_new_tokens} new tokens each ({tokens} output tokens):"]
    for name in (p for p in PATHS if p in seconds):
        ratio = "" if name == "engine" else f"   engine is {seconds[name] / seconds['engine']:.2f}x faster"
        lines.append(f"  {name:<11}{seconds[name]:8.2f} s  {tokens / seconds[name]:9.0f} output tokens/s{ratio}")
    if "engine_warmup" in seconds:
        compiles = int(seconds.get("engine_compiles", 0))
        lines.append(f"  engine warm-up {seconds['engine_warmup']:.2f} s, {compiles} decode-step compiles"
                     + (" (the run's kept step)" if compiles == 0 else ""))
    specs = device_specs(device_name)
    if specs is None:
        lines.append(f"  decode roofline: n/a (no memory bandwidth known for {device_name!r})")
    else:
        bound = decode_roofline_tokens_per_s(seconds["param_bytes"], w.kv_bytes_per_token(dtype_bytes), rows,
                                             w.prompt_len, w.max_new_tokens, specs[1])
        lines.append(f"  decode roofline at {specs[1] / 1e12:.2f} TB/s: {bound:.0f} output tokens/s; "
                     f"engine reaches {100 * tokens / seconds['engine'] / bound:.1f}% of it")
    return lines
