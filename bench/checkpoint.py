"""Checkpoint benchmark: our sharded save/load against ``dd`` and PyTorch DCP, in one run.

A state of ``--mib`` MiB of fp32 DTensors (``Shard(0)``, the FSDP2 layout) is spread over
``--ranks`` processes (gloo). For each of ``--repeat`` rounds it measures, on the same disk:

- ``dd if=/dev/zero bs=16M conv=fdatasync`` of the same number of bytes (the disk's ceiling);
- our synchronous save (``stage(copy=False)`` + write + fsync: no staging copy, as the caller
  waits anyway) and the step stall of an async save (stage +
  submit: the time the training loop is blocked), for a first save (staging into fresh memory)
  and a following one (reusing the staging buffers, the steady state of a training run), both
  without and with the staging buffers allocated ahead of the first save
  (``AsyncShardWriter.preallocate``, as a role does after building its model and after its first
  optimizer step; its own time is printed, it runs off the training thread); then our load
  (with sha256 verification and without);
- DCP's default ``FileSystemWriter`` save and ``FileSystemReader`` load of the same state.

With ``--device cuda`` the state lives on the GPUs (one per rank, nccl): staging then copies
into pinned host memory, whose allocation is what makes a first save without preallocated
buffers stall for seconds on a large state.

Loads read cold files (their pages are dropped from the page cache with ``posix_fadvise``) unless
``--warm``. Each figure is the best of the rounds; ratios are printed both from the best figures
and as the median of the per-round (paired) ratios, with the load average of the machine, as
other processes sharing the CPUs skew the CPU-bound parts (staging, hashing) the most.
Everything is written under a temporary folder in ``--dir`` and removed at the end.

    python bench/checkpoint.py --mib 512 --ranks 2 --dir /tmp
    python bench/checkpoint.py --mib 8192 --ranks 1 --device cuda --dir /local/nvme
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1024 * 1024
TENSOR_MIB = 32
COLS = 2048


def _drop_cache(folder: str) -> None:
    """Evict a folder's (clean) pages from the page cache; no root needed."""
    os.sync()
    for base, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _make_state(mib: int, mesh, rank: int, ranks: int, device: str = "cpu") -> dict:
    from torch.distributed.tensor import DTensor, Shard

    count = max(1, mib // TENSOR_MIB)
    rows = max(ranks, (mib * MIB // 4) // (count * COLS))
    rows -= rows % ranks
    g = torch.Generator().manual_seed(rank)
    state = {}
    for i in range(count):
        local = torch.randn(rows // ranks, COLS, generator=g).to(device)
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                         shape=(rows, COLS), stride=(COLS, 1))
    return {"model": state}


def _template(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {"model": {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                             run_check=False, shape=v.shape, stride=v.stride())
                      for k, v in state["model"].items()}}


def _worker(rank: int, ranks: int, root: str, mib: int, repeat: int, warm: bool, out_file: str,
            device: str = "cpu") -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from resilient_rl.checkpoint import AsyncShardWriter, Storage, load_shard_into, stage, write_shard

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{root}/pg-init",
                            rank=rank, world_size=ranks)
    mesh = init_device_mesh(device, (ranks,))
    state = _make_state(mib, mesh, rank, ranks, device)
    nbytes = sum(v.numel() * 4 for v in state["model"].values())  # global sizes
    storage = Storage(root)
    times: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn) -> object:
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        times[name].append(time.perf_counter() - t0)
        return result

    def settle(folder: str) -> None:
        dist.barrier()
        if rank == 0:
            (os.sync() if warm else _drop_cache(folder))
        dist.barrier()

    for i in range(repeat):
        if rank == 0:
            t0 = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", f"of={root}/dd.bin", "bs=16M",
                            f"count={max(1, nbytes // (16 * MIB))}", "conv=fdatasync"],
                           check=True, capture_output=True)
            times["dd"].append(time.perf_counter() - t0)
            os.unlink(f"{root}/dd.bin")
        dist.barrier()

        ours = f"ours_{i}"
        records = timed("ours_save", lambda: write_shard(stage(state, rank, copy=False), storage, ours, rank))
        gathered = [None] * ranks
        dist.all_gather_object(gathered, records)
        manifest = [r for rs in gathered for r in rs]

        # Two async saves in a row, as in training: the first stages into fresh memory, the
        # second reuses its buffers (the steady state). Then the same with the buffers
        # allocated before the first save (off the training thread in a run).
        for prefix in ("ours", "prealloc"):
            with AsyncShardWriter() as writer:
                if prefix == "prealloc":
                    t0 = time.perf_counter()
                    writer.preallocate(state, rank).result()
                    times["prealloc_allocate"].append(time.perf_counter() - t0)
                for label in ("first", "steady"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    future = writer.stage_and_submit(state, storage, f"{prefix}_async_{label}_{i}", rank)
                    stall = time.perf_counter() - t0
                    future.result()
                    dist.barrier()
                    total = time.perf_counter() - t0
                    stalls = [None] * ranks
                    dist.all_gather_object(stalls, stall)
                    times[f"{prefix}_stall_{label}"].append(max(stalls))
                    times[f"{prefix}_async_total_{label}"].append(total)

        peer = f"{root}/dcp_{i}"
        timed("dcp_save", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(peer)))

        settle(f"{root}/{ours}")
        template = _template(state)
        timed("ours_load", lambda: load_shard_into(template, storage, ours, manifest, rank=rank))
        assert all(torch.equal(template["model"][k].to_local(), v.to_local()) for k, v in state["model"].items())
        settle(f"{root}/{ours}")
        timed("ours_load_noverify", lambda: load_shard_into(_template(state), storage, ours, manifest,
                                                            verify=False, rank=rank))
        settle(peer)
        template = _template(state)
        timed("dcp_load", lambda: dcp.load(template, storage_reader=dcp.FileSystemReader(peer)))
        assert all(torch.equal(template["model"][k].to_local(), v.to_local()) for k, v in state["model"].items())
        dist.barrier()
        if rank == 0:
            for name in (ours, *(f"{p}_async_{label}_{i}" for p in ("ours", "prealloc")
                                 for label in ("first", "steady")), f"dcp_{i}"):
                shutil.rmtree(f"{root}/{name}", ignore_errors=True)
        dist.barrier()

    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"bytes": nbytes, "times": times}, f)
    dist.destroy_process_group()


RATIOS = [  # (label, numerator, denominator, target)
    ("stall / sync save (2nd+ save)", "ours_stall_steady", "ours_save", "<= 0.10"),
    ("stall / sync save (1st save)", "ours_stall_first", "ours_save", "fresh memory"),
    ("1st / 2nd+ save stall", "ours_stall_first", "ours_stall_steady", "fresh memory"),
    ("1st / 2nd+ save stall, preallocated", "prealloc_stall_first", "prealloc_stall_steady", "<= 1.2"),
    ("1st save stall: preallocated / not", "prealloc_stall_first", "ours_stall_first", "< 1"),
    ("ours / dd write throughput", "dd", "ours_save", ">= 0.70"),
    ("ours / DCP save throughput", "dcp_save", "ours_save", ">= 0.90"),
    ("ours / DCP load speed (verified)", "dcp_load", "ours_load", ">= 1.0"),
    ("ours / DCP load speed (no verify)", "dcp_load", "ours_load_noverify", ">= 1.0"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="global state size in MiB (default 512)")
    parser.add_argument("--ranks", type=int, default=2, help="processes sharing the state (default 2)")
    parser.add_argument("--dir", default="/tmp", help="parent folder of the temporary files (default /tmp)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--warm", action="store_true", help="load from the page cache instead of the disk")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the state lives (cuda: one GPU per rank, nccl; default cpu)")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} GPU(s) for "
                     f"{args.ranks} ranks")
    root = tempfile.mkdtemp(prefix="rrl-ckpt-bench-", dir=args.dir)
    out_file = os.path.join(root, "result.json")
    load_before = os.getloadavg()[0]
    try:
        mp.spawn(_worker, args=(args.ranks, root, args.mib, args.repeat, args.warm, out_file, args.device),
                 nprocs=args.ranks, join=True)
        with open(out_file) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = result["bytes"] / MIB
    times: dict[str, list[float]] = result["times"]
    best = {k: min(v) for k, v in times.items()}

    backend = "nccl, on GPU" if args.device == "cuda" else "gloo"
    print(f"checkpoint benchmark: {mib:.0f} MiB of fp32 DTensors over {args.ranks} ranks ({backend}), folder "
          f"{args.dir}, {args.repeat} rounds, {'warm' if args.warm else 'cold'} loads, load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    rows = [("dd bs=16M conv=fdatasync", "dd"), ("ours: sync save", "ours_save"),
            ("ours: async save 1, step stall", "ours_stall_first"),
            ("ours: async save 1, total", "ours_async_total_first"),
            ("ours: async save 2+, step stall", "ours_stall_steady"),
            ("ours: async save 2+, total", "ours_async_total_steady"),
            ("preallocating the buffers (bg)", "prealloc_allocate"),
            ("preallocated: save 1, step stall", "prealloc_stall_first"),
            ("preallocated: save 2+, step stall", "prealloc_stall_steady"),
            ("DCP FileSystemWriter save", "dcp_save"), ("ours: load (sha256 verified)", "ours_load"),
            ("ours: load (no verification)", "ours_load_noverify"), ("DCP FileSystemReader load", "dcp_load")]
    print(f"  {'(best of the rounds)':34s} {'time':>8s}  {'throughput':>13s}")
    for label, key in rows:
        print(f"  {label:34s} {best[key]:7.3f}s  {mib / best[key]:8.1f} MiB/s")
    # Ratios of the best figures, and the median of the ratios within each round (the two
    # sides of a paired ratio ran seconds apart, under the same load from other processes).
    print(f"  {'ratios':36s} {'best':>8s}  {'paired median':>13s}  target")
    for label, num, den, target in RATIOS:
        paired = statistics.median(a / b for a, b in zip(times[num], times[den]))
        print(f"  {label:36s} {best[num] / best[den]:8.3f}  {paired:13.3f}  {target}")


if __name__ == "__main__":
    main()
