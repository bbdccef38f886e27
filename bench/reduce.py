"""Gradient averaging of CPU replicas on one host: shared memory and a pipe barrier against gloo.

``--world`` processes in one gloo group run the loop of a replicated update: a burst of compute
(``--matmuls`` 200x200 matmuls, about the forward and backward of a mini-batch of the default tiny
model), then the average of ``--numel`` float32 gradients over the group. Three ways, interleaved
in rounds so that load from other processes hits each alike:

- ``gloo``: one all-reduce of the flat buffer (what ``ddp`` did before);
- ``shm+gloo barrier``: the shared-memory segment, meeting at a gloo barrier;
- ``shm+pipes``: :class:`~resilient_rl.workers.shm_reduce.SharedMemoryReducer`, which meets at a
  :class:`~resilient_rl.workers.pipe_barrier.PipeBarrier` (what ``ddp`` does now on one host).

Printed: per iteration, the loop's time and rank 0's time inside the reduction (arrival skew
included: the wait a step pays), and each way's ratio against gloo::

    python bench/reduce.py
    python bench/reduce.py --world 4 --numel 1000000
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

# Run from a checkout: the package next to this script wins over whatever else is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WAYS = ("gloo", "shm+gloo barrier", "shm+pipes")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--numel", type=int, default=105_000, help="float32 gradients (default: 105000, the tiny model's)")
    p.add_argument("--matmuls", type=int, default=12, help="200x200 matmuls per iteration (default: 12)")
    p.add_argument("--iters", type=int, default=200, help="iterations per way and round (default: 200)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the three ways (default: 3)")
    args = p.parse_args(argv)
    if args.world < 2 or args.numel < 1 or args.matmuls < 0 or args.iters < 1 or args.rounds < 1:
        p.error("--world must be >= 2, --numel, --iters and --rounds >= 1, --matmuls >= 0")
    return args


def _rank(rank: int, args: argparse.Namespace, port: int, out) -> None:
    from resilient_rl.workers.shm_reduce import SharedMemoryReducer, open_reducer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, args.world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world)
    try:
        reducer = open_reducer(args.numel, torch.float32)
        if reducer is None:
            raise SystemExit("bench/reduce.py: shared memory is not available here")

        class GlooBarrier:  # the same segment, meeting at a gloo barrier instead of the pipes
            rank, world = reducer.rank, reducer.world

            def wait(self) -> None:
                dist.barrier()

        gloo_barrier = SharedMemoryReducer(reducer._slots, GlooBarrier())
        a = torch.randn(200, 200)
        grads = [torch.randn(args.numel)]

        def average(way: str) -> None:
            if way == "gloo":
                dist.all_reduce(grads[0])
                grads[0].div_(args.world)
            else:
                (reducer if way == "shm+pipes" else gloo_barrier).average_(grads)

        results = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                dist.barrier()
                waited = 0.0
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    for _ in range(args.matmuls):
                        a @ a
                    t = time.perf_counter()
                    average(way)
                    waited += time.perf_counter() - t
                results[way].append(((time.perf_counter() - t0) / args.iters, waited / args.iters))
        if rank == 0:
            out.put(results)
        reducer.close()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        results = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    print(f"{args.world} processes, {args.numel} float32 ({args.numel * 4 / 2**20:.2f} MiB), {args.matmuls} "
          f"matmuls per iteration, {args.iters} iterations x {args.rounds} rounds (medians over rounds), "
          f"{os.cpu_count()} CPUs")
    base_loop = statistics.median(r[0] for r in results["gloo"])
    base_wait = statistics.median(r[1] for r in results["gloo"])
    print(f"{'':<18}{'loop ms/iter':>14}{'x gloo':>8}{'reduce ms/iter':>16}{'x gloo':>8}")
    for way in WAYS:
        loop = statistics.median(r[0] for r in results[way])
        wait = statistics.median(r[1] for r in results[way])
        print(f"{way:<18}{1e3 * loop:>14.3f}{loop / base_loop:>8.2f}{1e3 * wait:>16.3f}{wait / base_wait:>8.2f}")


if __name__ == "__main__":
    main()
