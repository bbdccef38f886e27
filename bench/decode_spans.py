"""The rollout engine reading its KV cache up to the current column (spans) against reading every
column of the cache at each decode step (the engine before spans), in the same run.

A model of a workload's shape (``--workload``, bench/gpu_workloads.py; random weights, bf16 on a
GPU, compiled with CUDA graphs there) or a small one on the CPU (eager unless ``--compile``), and
``--rows`` random prompts of ``--prompt`` tokens with no stop id, so every row decodes
``--new-tokens`` tokens. Prints the best of ``--repeats`` generations each way and their ratio.

    python bench/decode_spans.py                                   # CPU: 64 rows, 32 + 990 tokens
    python bench/decode_spans.py --workload gsm8k-0.5b --rows 512 --prompt 256 --new-tokens 512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import decode_model, device, small_qwen2, synchronize  # noqa: E402  (this script's folder)
from gpu_workloads import WORKLOADS  # noqa: E402

#: The CPU's model when no workload is named: a Qwen2 shape small enough for a 2-core machine.
CPU_CONFIG = small_qwen2(2, hidden=128, vocab=256)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=990)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compile the decode step on the CPU too")
    args = p.parse_args(argv)

    import resilient_rl.models.engine as engine

    cuda = device() == "cuda"
    config = WORKLOADS[args.workload].hf_config if args.workload else CPU_CONFIG
    model = decode_model(config)
    ids = torch.randint(8, config["vocab_size"], (args.rows, args.prompt), device=device())
    mask = torch.ones_like(ids)
    spans_init = engine._EngineDecoder.__init__

    def whole_cache_init(self, *a, **kw):  # one span: every column of the cache at every step
        spans_init(self, *a, **kw)
        self.span_step = self.cache.capacity[1]

    def generation() -> float:
        synchronize()
        t0 = time.perf_counter()
        engine.generate_static(model, ids, mask, max_new_tokens=args.new_tokens, temperature=1.0,
                               compile=cuda or args.compile, generator=torch.Generator(device=device()).manual_seed(0))
        synchronize()
        return time.perf_counter() - t0

    best = {}
    try:
        for name, init in (("whole cache", whole_cache_init), ("spans", spans_init)):
            engine._EngineDecoder.__init__ = init
            generation()  # compiles (once for both: the span is a symbol), captures the graphs
            best[name] = min(generation() for _ in range(args.repeats))
    finally:
        engine._EngineDecoder.__init__ = spans_init
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"{args.rows} rows x ({args.prompt} prompt + {args.new_tokens} new tokens), {where}, "
          f"{'compiled' if cuda or args.compile else 'eager'}, best of {args.repeats}:")
    for name, secs in best.items():
        print(f"  {name:<12} {secs:8.2f} s  {args.rows * args.new_tokens / secs:10.0f} output tokens/s")
    print(f"  spans / whole cache: {best['spans'] / best['whole cache']:.2f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
