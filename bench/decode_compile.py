"""What compiling the rollout engine's decode step costs: the first generation (which compiles the
step, once for every batch size it decodes at) against the second (which reuses the compiled
step), and the compiler's own count of graphs and graph breaks.

A Qwen2-shaped model from a config (random weights; ``--layers``, ``--hidden`` and friends), one
batch of ``--rows`` rows whose stop set ends them at different lengths, so that compaction visits
several batch buckets. On a GPU the step is captured in CUDA graphs too; on CPU it is compiled the
same way, CUDA graphs aside. ``--backend aot_eager`` leaves inductor out (the tracing alone).

    python bench/decode_compile.py --layers 24                      # 0.5 B's depth, small width
    python bench/decode_compile.py --layers 24 --backend aot_eager  # dynamo + AOT autograd only
"""

from __future__ import annotations

import argparse
import time

import torch

from decode_bench import decode_model, device, small_qwen2, synchronize


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--backend", default="inductor", help="torch.compile back end (default: inductor)")
    p.add_argument("--fused", action="store_true", help="the projections fused, as a rollout model's are")
    args = p.parse_args(argv)

    from resilient_rl.models.decode_step import DecodeStep
    from resilient_rl.models.engine import generate_static

    model = decode_model(small_qwen2(args.layers, args.hidden, args.heads, args.kv_heads, args.vocab), args.fused)
    DecodeStep.backend = args.backend
    ids = torch.randint(8, args.vocab, (args.rows, 32), device=device())
    mask = torch.ones_like(ids)
    # About one row in (new tokens / 2) ends at each token: rows finish at different lengths.
    stops = list(range(8, 8 + max(1, 2 * args.vocab // args.new_tokens)))

    def generation() -> tuple[float, dict]:
        synchronize()
        t0 = time.perf_counter()
        out = generate_static(model, ids, mask, max_new_tokens=args.new_tokens, eos_token_id=stops, compile=True,
                              check_every=4, generator=torch.Generator(device=device()).manual_seed(0))
        synchronize()
        return time.perf_counter() - t0, out.engine_stats

    first, stats = generation()
    second, again = generation()
    print(f"{args.layers} layers, hidden {args.hidden}, {args.rows} rows on {device()} ({args.backend}): batch sizes "
          f"{stats['buckets']}, {stats['compiles']} compiles, {stats['graph_breaks']} graph breaks")
    print(f"first generation {first:.1f} s, second {second:.2f} s ({again['compiles']} compiles): compiling cost "
          f"{first - second:.1f} s, {(first - second) / max(stats['compiles'], 1):.1f} s per compile; "
          f"first / second = {first / second:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
