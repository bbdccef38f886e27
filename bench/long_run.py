"""Per-step bookkeeping of the controller over a long run: does its cost grow with the step count?

Measures, after ``n`` steps already recorded, the time of the next 1000 steps of

- goodput's useful time: :class:`UsefulTime` (running totals) against the previous approach
  (a dict of step durations summed on every step);
- a restore of ``metrics.jsonl`` to ``n - 10`` rows and the reading of the last 1,000 rows the
  trainer keeps in memory: ``RunDir.truncate_metrics_after`` and ``read_metrics(last=)``, which
  read the file from its end, against the previous reads of the whole file from its start.

Prints each as a ratio against the same measurement at ``n = 1000`` in the same run: a ratio
near 1 means O(1) per step, one near ``n / 1000`` means O(n).

    python bench/long_run.py            # n = 1000, 20000, 100000 (about a minute)
    python bench/long_run.py --quick    # n = 1000, 10000
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import deque

from resilient_rl.jsonl import read_jsonl
from resilient_rl.run.folder import RunDir
from resilient_rl.telemetry.goodput import UsefulTime

BLOCK = 1000
KEPT = 1000  # rows of history the trainer keeps in memory (trainer.ppo.HISTORY_WINDOW)


def _best(fn, repeats: int = 7) -> float:
    """Least time of ``repeats`` runs: the machine is shared, the minimum is the code's cost."""
    return min(fn() for _ in range(repeats))


def useful_new(n: int) -> float:
    u = UsefulTime()
    for s in range(1, n + 1):
        u.record(s, 0.5)

    def block() -> float:
        u.rollback(n)
        t0 = time.perf_counter()
        for s in range(n + 1, n + BLOCK + 1):
            u.record(s, 0.5)
            _ = u.total
        return time.perf_counter() - t0
    return _best(block)


def useful_old(n: int) -> float:
    d = {s: 0.5 for s in range(1, n + 1)}

    def block() -> float:
        t0 = time.perf_counter()
        for s in range(n + 1, n + BLOCK + 1):
            d[s] = 0.5
            _ = sum(d.values())
        return time.perf_counter() - t0
    return _best(block, 3)


def _metrics(folder: str, n: int) -> RunDir:
    rd = RunDir(folder, f"r{n}")
    row = {f"k{i}": 0.1 * i for i in range(40)}
    with open(rd.metrics_path, "w") as f:
        for s in range(1, n + 1):
            f.write(json.dumps({"step": s, **row}) + "\n")
    return rd


def restore_new(folder: str, n: int) -> float:
    rd = _metrics(folder, n)
    t0 = time.perf_counter()
    rd.truncate_metrics_after(n - 10)
    rd.read_metrics(last=KEPT)
    return time.perf_counter() - t0


def restore_old(folder: str, n: int) -> float:
    """Every row parsed from the start to find the cut, then again to keep the last ones."""
    rd = _metrics(folder, n)
    t0 = time.perf_counter()
    cut, offset = None, 0
    with open(rd.metrics_path, "rb") as f:
        for raw in f:
            if cut is None and json.loads(raw)["step"] > n - 10:
                cut = offset
            offset += len(raw)
    os.truncate(rd.metrics_path, cut)
    deque(read_jsonl(rd.metrics_path), maxlen=KEPT)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    sizes = [1000, 10000] if args.quick else [1000, 20000, 100000]
    with tempfile.TemporaryDirectory() as folder:
        base = {name: fn(sizes[0]) if "useful" in name else fn(folder, sizes[0])
                for name, fn in (("useful_new", useful_new), ("useful_old", useful_old))}
        print(f"{'n':>8}  {'useful time (new)':>18}  {'useful time (old)':>18}  "
              f"{'restore, from end':>18}  {'restore, from start':>22}")
        r0 = {"new": restore_new(folder, sizes[0]), "old": restore_old(folder, sizes[0])}
        for n in sizes:
            un, uo = useful_new(n), useful_old(n)
            rn, ro = restore_new(folder, n), restore_old(folder, n)
            print(f"{n:>8}  {un / base['useful_new']:>17.2f}x  {uo / base['useful_old']:>17.2f}x  "
                  f"{rn / r0['new']:>17.2f}x  {ro / r0['old']:>21.2f}x")
        print("(each column: time at n / time at n=1000 of the same code; restore: absolute at the largest n "
              f"new {rn * 1000:.1f} ms, old {ro * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
