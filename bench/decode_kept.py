"""What running the kept decode step costs per step, against the step compiled as before: each
decode step first finds the kept version whose guards accept its arguments (the compiler checks
its own guards on every call too). Each case is a fresh interpreter with its own compile cache,
run twice, alternating; the median of five warm generations each.

    python bench/decode_kept.py --layers 4
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
from resilient_rl.models.decode_step import DecodeStep
from resilient_rl.models.engine import generate_static

kept, config, rows = sys.argv[1] == "1", json.loads(sys.argv[2]), int(sys.argv[3])
if not kept:
    DecodeStep.kept_failure = "compiled as before (bench case)"
model = decode_model(config)
ids = torch.randint(8, config["vocab_size"], (rows, 16), device=device())


def generation():
    out = generate_static(model, ids, torch.ones_like(ids), max_new_tokens=128, compile=True, check_every=8,
                          generator=torch.Generator(device=device()).manual_seed(0))
    synchronize()
    return out


generation()
times = []
for _ in range(5):
    t0 = time.perf_counter()
    out = generation()
    times.append(time.perf_counter() - t0)
print(json.dumps({"ms_per_step": sorted(times)[2] / out.engine_stats["steps"] * 1e3,
                  "kept": out.engine_stats["kept"], "compiles": out.engine_stats["compiles"]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args(argv)
    config = json.dumps(small_qwen2(args.layers))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {True: [], False: []}
        for _ in range(2):
            for kept in (False, True):
                runs[kept].append(run_fresh(CASE, int(kept), config, args.rows, cache=os.path.join(tmp, str(kept))))
    base = min(r["ms_per_step"] for r in runs[False])
    print(f"{args.layers} layers, {args.rows} rows; ms per decode step (best of two processes, median of five)")
    for kept, name in ((False, "compiled as before"), (True, "kept version")):
        best = min(r["ms_per_step"] for r in runs[kept])
        print(f"  {name:20s} {best:7.3f} ms  ({best / base:.2f}x)  kept {runs[kept][0]['kept']}")
    if not all(r["kept"] for r in runs[True]) or any(r["kept"] for r in runs[False]):
        print("  a case did not run the path it names")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
