"""The snapshot checksum on a recovery's path: xxh3 over pieces on several threads against the
whole bytes in one piece on one thread (the checksum sealed before), on the same buffer.

A restore checks a copy's checksum before it writes anything into the rank, so the check is part
of every recovery's restore phase: a 0.5 B actor's state (fp32 weights and AdamW's two moments) is
6.5 GB, a 1.5 B actor's 18.6 GB. Prints the median seconds of each over ``--repeats`` alternated
runs, the GB/s and the ratio to the one-piece checksum.

    python bench/snapshot_checksum.py --gib 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from resilient_rl.workers.snapshots import meta  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="size of the buffer in GiB (default: 2)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each, alternated (default: 5)")
    args = p.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        p.error("--gib must be > 0 and --repeats >= 1")
    data = np.random.default_rng(0).integers(0, 256, int(args.gib * 2**30), dtype=np.uint8)
    ways = {"one piece, one thread": meta.WHOLE, f"pieces of {meta.PIECE >> 20} MiB, {meta.THREADS} threads":
            meta.ALGORITHM}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    meta.checksum(data[: meta.PIECE * 2])  # the thread pool started
    for _ in range(args.repeats):
        for name, algorithm in ways.items():
            t0 = time.perf_counter()
            meta.checksum(data, algorithm=algorithm)
            seconds[name].append(time.perf_counter() - t0)
    base = statistics.median(next(iter(seconds.values())))
    print(f"checksum of {data.nbytes / 1e9:.2f} GB, median of {args.repeats}:")
    for name, times in seconds.items():
        s = statistics.median(times)
        print(f"  {name:<32} {s:7.3f} s  {data.nbytes / s / 1e9:6.1f} GB/s  {s / base:5.2f}x")


if __name__ == "__main__":
    main()
