"""An empty rollout's build and its first weight sync, as a rank that replaces a killed one makes
them: its fused projections' weights copied from the never-written weights they replace (before)
against only allocated (now, ``fuse_projections(copy=False)``).

Each measurement runs in a fresh process, which imports the model's code first, as a warm spare
has (so the build's time is the build's); the two ways alternate ``--repeats`` times and the
medians are printed, with the ratio of build plus first write. The first write fills every weight
in place, as the first sync's copies do.

    python bench/rollout_build.py
    python bench/rollout_build.py --workload gsm8k-1.5b --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, tempfile, time
import torch, yaml
sys.path.insert(0, sys.argv[3])
from gpu_workloads import WORKLOADS
from resilient_rl.config.schema import load_config
from resilient_rl.models.factory import import_model_code
from resilient_rl.models.fused_projections import fuse_projections
from resilient_rl.workers.fsdp import plan_device
import resilient_rl.workers.rollout as rollout

name, _, size = sys.argv[1].partition(":")
w = WORKLOADS[name].tiny() if size == "tiny" else WORKLOADS[name]
with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
    yaml.safe_dump({"model": {"kind": "hf", "hf_config": w.hf_config, "max_seq_len": 64},
                    "trainer": {"device": "cpu"}}, f)
    f.flush()
    cfg = load_config(f.name, [])
import_model_code(cfg.model)
if sys.argv[2] == "copied":
    rollout.fuse_projections = lambda model, copy=True: fuse_projections(model, copy=True)
t0 = time.perf_counter()
engine = rollout.RolloutEngine(cfg.model, cfg.rollout, w.tokenizer_vocab, 0, plan_device("cpu", cfg.model.dtype),
                               None, 0, empty=True)
t1 = time.perf_counter()
with torch.no_grad():
    for p in engine.model.parameters():
        p.fill_(0.01)
t2 = time.perf_counter()
print(json.dumps({"build": t1 - t0, "write": t2 - t1}))
"""


def fresh(workload: str, way: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHILD, workload, way, str(ROOT / "bench")], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_workloads import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-0.5b")
    p.add_argument("--tiny", action="store_true", help="the workload's tiny dimensions (a check of the script)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    name = WORKLOADS[args.workload].tiny().name if args.tiny else args.workload
    runs: dict[str, list[dict]] = {"copied": [], "allocated": []}
    for _ in range(args.repeats):
        for way in runs:
            runs[way].append(fresh(f"{args.workload}:tiny" if args.tiny else args.workload, way))
    print(f"an empty rollout of {name} on this CPU, fresh processes, median of {args.repeats}:")
    total = {}
    for way, label in (("copied", "fused weights copied (before)"), ("allocated", "fused weights allocated (now)")):
        build = statistics.median(r["build"] for r in runs[way])
        write = statistics.median(r["write"] for r in runs[way])
        total[way] = build + write
        print(f"  {label:<30} build {build:6.2f} s, first write {write:5.2f} s, together {total[way]:6.2f} s")
    print(f"  ratio: {total['allocated'] / total['copied']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
