"""Reading checkpoints on an object store: verify, resume discovery and ``checkpoints list``.

A run of ``--steps`` committed steps, each with the shard pairs of ``--ranks`` ranks in two roles
and a trainer state, plus a timeline of two steps set aside in ``abandoned/``, is written to a
``memory://`` root behind the fault-injecting filesystem, which then delays every request by
``--latency-ms`` (a data read, a listing, a metadata query: an object store's round trip). With
``--store object`` (the default) it lists like S3, a folder tree in one listing of ``--page-keys``
keys per request; with ``--store tree`` folder by folder, like a file system.

Timed, each side in turn for ``--repeat`` rounds (median), with the requests counted:

- ``verify``: a deep verification of the newest step (every file hashed against the manifest);
- ``resume``: finding the step a resume loads (the committed steps, then a deep verify);
- ``list``: what ``resilient-rl checkpoints list`` reads (:func:`inspect_run`).

The baseline is the code before these reads were made concurrent, measured in the same run: every
request one after the other (``fanout.MAX_WORKERS = 1``), and ``checkpoints list`` walking every
file of the run (``abandoned/`` included) and asking for each step's manifest again to find the
step a resume loads.

    python bench/store_listing.py                                  # 6 steps of 258 files, 10 ms
    python bench/store_listing.py --steps 3 --ranks 16 --repeat 1   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.checkpoint import fanout
from resilient_rl.checkpoint.inspect import CheckpointLocation, inspect_run, list_checkpoints
from resilient_rl.checkpoint.leases.run_lease import read_lease
from resilient_rl.checkpoint.manager import ABANDONED_DIR
from resilient_rl.checkpoint.manifest import LATEST_NAME
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.faults.storage import FaultPlan
from resilient_rl.testing.checkpoint_store import FAST, faulty_store, save_shard_files

ROLES = ("actor", "critic")
SHARD_BYTES = 512


def build_run(manager: CheckpointManager, steps: int, ranks: int) -> None:
    for step in range(1, steps + 1):
        save_shard_files(manager, step, ranks, ROLES, lambda role, rank, suffix: os.urandom(SHARD_BYTES))


def walking_list(url: str, options: dict) -> None:
    """The reads ``checkpoints list`` made before: a walk of every file of the run, the run's top
    level again, then each manifest; the step a resume loads found from scratch."""
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    manager.storage.exists("run")
    manager.storage.try_read_bytes(Storage.join("run", LATEST_NAME))
    for step, files in sorted(manager.step_folders().items()):
        manager.verifier.check(manager.step_rel(step), manager.load_manifest(step), files, deep=False)
    read_lease(manager.storage, "run")
    manager.storage.ls(Storage.join("run", ABANDONED_DIR))
    manager.latest_step()


def paged(fs, page_keys: int) -> None:
    """Charge a recursive listing one request per ``page_keys`` keys, as S3's ListObjectsV2 does."""
    real = fs.find

    def find(path, *args, **kwargs):
        found = real(path, *args, **kwargs)
        for _ in range(max(0, (len(found) - 1) // page_keys)):
            fs._query("list", path)
        return found
    fs.find = find


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="committed steps in the run")
    p.add_argument("--ranks", type=int, default=64, help="ranks per role: two shard files each, two roles")
    p.add_argument("--latency-ms", type=float, default=10.0, help="delay of every storage request")
    p.add_argument("--store", choices=("object", "tree"), default="object", help="how folders are listed")
    p.add_argument("--page-keys", type=int, default=1000, help="keys per request of an object store's listing")
    p.add_argument("--repeat", type=int, default=3, help="rounds on each side (median)")
    args = p.parse_args(argv)
    if min(args.steps, args.ranks, args.repeat, args.page_keys) < 1 or args.latency_ms < 0:
        p.error("--steps, --ranks, --repeat and --page-keys must be >= 1, --latency-ms >= 0")
    url, options, fs = faulty_store(FaultPlan(), "put" if args.store == "object" else "")
    paged(fs, args.page_keys)
    build_run(CheckpointManager(url, "run", keep_last=args.steps, storage_options=options, retry=FAST),
              args.steps, args.ranks)
    fs.plan.query_s = fs.plan.slow_s = args.latency_ms / 1e3

    def fresh() -> CheckpointManager:  # no deep verification remembered
        return CheckpointManager(url, "run", storage_options=options, retry=FAST)
    loc = CheckpointLocation(url, "run")
    cases: dict[str, dict[str, Callable[[], object]]] = {
        "verify": {"baseline": lambda: fresh().verify(args.steps), "this code": lambda: fresh().verify(args.steps)},
        "resume": {"baseline": lambda: fresh().find_latest_valid(), "this code": lambda: fresh().find_latest_valid()},
        "list": {"baseline": lambda: walking_list(url, options),
                 "this code": lambda: inspect_run(loc, deep=False, storage_options=options)},
    }
    expect = {"verify": "ok", "resume": args.steps}
    files = 2 * len(ROLES) * args.ranks + 2
    print(f"run: {args.steps} steps of {files} files, {2 * 2 * len(ROLES) * args.ranks} files set aside; "
          f"{args.latency_ms:g} ms per request, {args.store} store listing; {args.repeat} round(s), median")
    for case, sides in cases.items():
        times: dict[str, list[float]] = {side: [] for side in sides}
        requests: dict[str, int] = {}
        for _ in range(args.repeat):
            for side, fn in sides.items():
                fanout.MAX_WORKERS = 1 if side == "baseline" else None
                fs.requests.clear()
                t0 = time.perf_counter()
                result = fn()
                times[side].append(time.perf_counter() - t0)
                requests[side] = sum(fs.requests.values())
                assert case not in expect or result == expect[case], (case, side, result)
        fanout.MAX_WORKERS = None
        base, ours = (statistics.median(times[s]) for s in ("baseline", "this code"))
        print(f"  {case:>6}: baseline {base * 1e3:8.1f} ms, {requests['baseline']:5d} requests | this code "
              f"{ours * 1e3:8.1f} ms, {requests['this code']:5d} requests | baseline / this code {base / ours:5.1f}x")
    rows = [(i.step, i.status) for i in list_checkpoints(fresh())]
    assert rows == [(s, "ok") for s in range(1, args.steps + 1)], rows


if __name__ == "__main__":
    main()
