"""Where the rollout engine's decode step spends its time: per-step milliseconds eager, compiled
(CUDA graphs on a GPU), compiled without CUDA graphs and compiled with the model's projections
unfused (seven products a layer instead of four: ``resilient_rl/models/fused_projections.py``),
with the ratio of the fused step to the unfused one, then the profiler's kernel table of a short
compiled generation.

A workload's model (``--workload``, bench/gpu_workloads.py; random weights, bf16 on a GPU) and
``--rows`` left-aligned random prompts of its prompt length, no stop id (every row decodes every
step, one batch bucket). A step's time is the difference of a long and a short generation over
their token difference, so prefill and compilation are left out. Without a GPU the workload runs
at its tiny dimensions on the CPU (compiled without CUDA graphs), a check of the script only.

    python bench/decode_profile.py --workload gsm8k-0.5b --rows 512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import decode_model, device, synchronize  # noqa: E402  (this script's folder)
from gpu_workloads import WORKLOADS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-0.5b")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed (default: 64)")
    p.add_argument("--profile-tokens", type=int, default=24, help="tokens of the profiled generation")
    args = p.parse_args(argv)

    from resilient_rl.models.engine import generate_static

    cuda = device() == "cuda"
    w = WORKLOADS[args.workload] if cuda else WORKLOADS[args.workload].tiny()
    models = {True: decode_model(w.hf_config, fused=True), False: decode_model(w.hf_config)}
    ids = torch.randint(8, w.tokenizer_vocab, (args.rows, w.prompt_len), device=device())
    mask = torch.ones_like(ids)

    def generation(tokens: int, fused: bool = True, **kw) -> tuple[float, dict]:
        synchronize()
        t0 = time.perf_counter()
        out = generate_static(models[fused], ids, mask, max_new_tokens=tokens, temperature=1.0,
                              generator=torch.Generator(device=device()).manual_seed(0), **kw)
        synchronize()
        return time.perf_counter() - t0, out.engine_stats

    variants = {"eager": {"compile": False}, "compiled": {"compile": True},
                "compiled, no CUDA graphs": {"compile": True, "cuda_graphs": False},
                "compiled, unfused": {"compile": True, "fused": False}}
    if not cuda:
        del variants["compiled"]  # the same as without CUDA graphs
        variants["compiled, unfused"]["cuda_graphs"] = False
    fused_way = "compiled" if cuda else "compiled, no CUDA graphs"
    print(f"{w.name} on {torch.cuda.get_device_name(0) if cuda else 'CPU'}: {args.rows} rows, prompt "
          f"{w.prompt_len}, {w.layers} layers")
    step_ms = {}
    for name, kw in variants.items():
        first, stats = generation(8, **kw)  # compiles, captures the graphs
        long, _ = generation(8 + args.tokens, **kw)
        short, _ = generation(8, **kw)
        step_ms[name] = 1e3 * (long - short) / args.tokens
        print(f"  {name:<25} {step_ms[name]:8.2f} ms per decode step (first generation "
              f"{first:.1f} s; {stats['compiles']} compiles, eager fallback: {stats['eager_fallback']})", flush=True)
    print(f"  projections fused / unfused, compiled: {step_ms[fused_way] / step_ms['compiled, unfused']:.2f}x")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        generation(args.profile_tokens, compile=True)
    order = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=order, row_limit=15, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
