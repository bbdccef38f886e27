"""What the run's kept decode step (traced and compiled) saves a process that starts on another
node: the first generation of a fresh process (which compiles the decode step) with an empty local
compile cache, against the same with the run's kept step loaded first, and with the node's own
cache warm too (a process restarted on the node where the step was compiled); the loading is
counted. Each case is a fresh interpreter.

A Qwen2-shaped model from a config (random weights), rows ending at different lengths so that
compaction visits several batch buckets, as ``bench/decode_compile.py``.

    python bench/compile_cache.py --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from decode_bench import run_fresh, small_qwen2

CASE = r"""
import json, sys, time
import torch
from decode_bench import decode_model, device, synchronize
from resilient_rl.models.engine import generate_static
from resilient_rl.workers.compile_cache import CompileCache

root, config, steps = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
adopt, publish = "adopt" in steps, "publish" in steps
cache = CompileCache(root, "bench")
model = decode_model(config)
t0 = time.perf_counter()
loaded = cache.adopt(device(), model) if adopt else 0
t_adopt = time.perf_counter() - t0
ids = torch.randint(8, config["vocab_size"], (64, 32), device=device())
t0 = time.perf_counter()
out = generate_static(model, ids, torch.ones_like(ids), max_new_tokens=48, eos_token_id=list(range(8, 50)),
                      compile=True, check_every=4, generator=torch.Generator(device=device()).manual_seed(0))
synchronize()
first = time.perf_counter() - t0
from torch._dynamo.utils import counters
print(json.dumps({"adopt_s": t_adopt, "loaded": loaded, "first_s": first, "compiles": out.engine_stats["compiles"],
                  "published": cache.publish(device(), model) if publish else 0, "inductor": dict(counters["inductor"]),
                  "eager": out.engine_stats["eager_fallback"], "kept": out.engine_stats["kept"]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root, node_a, node_b = (os.path.join(tmp, n) for n in ("ckpt", "node-a", "node-b"))
        config = json.dumps(small_qwen2(args.layers))
        cold = run_fresh(CASE, root, config, "publish", cache=node_a)  # compiles; keeps the step
        other = run_fresh(CASE, root, config, "adopt", cache=node_b)  # another node: the run's kept step
        same = run_fresh(CASE, root, config, "adopt", cache=node_a)  # the same node, its own cache too
    rows = [("empty local cache (compiles)", cold), ("another node, the run's kept step", other),
            ("the same node, its own cache too", same)]
    print(f"{args.layers} layers; first generation of a fresh process, {cold['published'] / 2**20:.1f} MiB kept "
          "for the run (the traced step and the compiler's artifacts)")
    for name, r in rows:
        total = r["adopt_s"] + r["first_s"]
        print(f"  {name:36s} {total:6.1f} s  ({total / (cold['adopt_s'] + cold['first_s']):.2f}x)  "
              f"loading {r['adopt_s']:.1f} s, first generation {r['first_s']:.1f} s, "
              f"compiles {r['compiles']}, kept step {r['kept']}")
    eager = [name for name, r in rows if r["eager"]]
    if eager:  # a fast case that decoded eagerly measured nothing about the compile cache
        reason = next(r["eager"] for _, r in rows if r["eager"])
        print(f"  the compiled step failed and decoded eagerly in: {', '.join(eager)} ({reason})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
