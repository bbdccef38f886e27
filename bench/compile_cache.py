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
import subprocess
import sys
import tempfile
import time

CASE = r"""
import json, sys, time
import torch
from resilient_rl.models.engine import generate_static
from resilient_rl.models.hf import load_hf_causal_lm
from resilient_rl.workers.compile_cache import CompileCache

root, layers, adopt, publish = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
device = "cuda" if torch.cuda.is_available() else "cpu"
cache = CompileCache(root, "bench")
config = {"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": layers,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "max_position_embeddings": 4096, "tie_word_embeddings": True}
torch.manual_seed(0)
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = load_hf_causal_lm(hf_config=config).to(device=device, dtype=dtype).eval()
t0 = time.perf_counter()
loaded = cache.adopt(device, model) if adopt else 0
t_adopt = time.perf_counter() - t0
ids = torch.randint(8, 1024, (64, 32), device=device)
t0 = time.perf_counter()
out = generate_static(model, ids, torch.ones_like(ids), max_new_tokens=48, eos_token_id=list(range(8, 50)),
                      compile=True, check_every=4, generator=torch.Generator(device=device).manual_seed(0))
if device == "cuda":
    torch.cuda.synchronize()
first = time.perf_counter() - t0
from torch._dynamo.utils import counters
print(json.dumps({"adopt_s": t_adopt, "loaded": loaded, "first_s": first, "compiles": out.engine_stats["compiles"],
                  "published": cache.publish(device, model) if publish else 0, "inductor": dict(counters["inductor"]),
                  "eager": out.engine_stats["eager_fallback"], "kept": out.engine_stats["kept"]}))
"""


def case(root: str, local: str, layers: int, adopt: bool, publish: bool) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": local}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CASE, root, str(layers), str(int(adopt)), str(int(publish))],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root, node_a, node_b = (os.path.join(tmp, n) for n in ("ckpt", "node-a", "node-b"))
        cold = case(root, node_a, args.layers, adopt=False, publish=True)  # compiles; keeps the step
        other = case(root, node_b, args.layers, adopt=True, publish=False)  # another node: the run's kept step
        same = case(root, node_a, args.layers, adopt=True, publish=False)  # the same node, its own cache too
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
