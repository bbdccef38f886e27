"""What the decode-step benchmarks share (``decode_compile``, ``decode_kept``, ``compile_cache``,
``decode_spans``, ``decode_profile``): a small Qwen2 shape, the model built on the device a run
would use, and one case run in a fresh interpreter.

- **The device**: the GPU when torch sees one (bf16, as the rollout runs it), else the CPU (fp32).
- **A fresh interpreter** per case, with its own inductor cache folder: what a new rollout process
  pays (tracing, compiling, loading a kept step) is then measured, not what this process's
  compiler already holds in memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpu_workloads import qwen2_config

BENCH = Path(__file__).resolve().parent


def small_qwen2(layers: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 1024) -> dict:
    """A Qwen2 config narrow enough for a CPU, ``layers`` deep (grouped-query attention, tied head)."""
    return qwen2_config(hidden, layers, heads, kv_heads, 2 * hidden, vocab=vocab)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def decode_model(config: dict, fused: bool = False) -> torch.nn.Module:
    """The model of ``config`` with random weights (seed 0) on :func:`device`, bf16 on a GPU, in
    eval mode; with ``fused``, its projections fused as a rollout's are
    (``resilient_rl/models/fused_projections.py``; bench/decode_profile.py times both)."""
    from resilient_rl.models.fused_projections import fuse_projections
    from resilient_rl.models.hf import load_hf_causal_lm
    from resilient_rl.models.precision import cast_parameters

    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config=config).to(device()).eval()
    if device() == "cuda":
        cast_parameters(model, torch.bfloat16)  # as the rollout casts them: rotary frequencies stay fp32
    if fused:
        fuse_projections(model)
    return model


def synchronize() -> None:
    """Waits for the GPU's queued work (nothing on a CPU), so that a timer around it measures it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(fn, repeat: int) -> float:
    """The fewest seconds of ``repeat`` calls of ``fn``, each timed from and to an idle device."""
    best = float("inf")
    for _ in range(repeat):
        synchronize()
        t0 = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run_fresh(code: str, *args, cache: str) -> dict:
    """``python -c code args...`` with ``TORCHINDUCTOR_CACHE_DIR=cache``; ``code`` can import this
    module. Returns the dict it printed as JSON on its last line, with the whole process's seconds
    as ``process_s``; a failed case ends the benchmark with its stderr."""
    path = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t0}
