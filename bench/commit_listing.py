"""What a checkpoint commit lists as a run ages: many kept steps, a large ``abandoned/``.

A local run holds ``--kept`` committed steps (multiples of ``checkpoint.keep_every``, which
retention keeps), each with ``--ranks`` ranks' shard pairs and a trainer state, and an
``abandoned/`` folder of ``--aside-files`` files (two timelines set aside by restores). Then
``--commits`` steps are committed, each one in turn by

- this code's :meth:`CheckpointManager.commit`, which lists the run's top level once and asks for
  each step folder's manifest;
- the baseline: the same commit finding the committed steps the way it did before, a recursive
  listing of every file of the run, ``abandoned/`` included, for the set-aside check and again for
  retention.

Both start from copies of the same run folder. Printed: the listings one commit makes, and the
median time of a commit on each side (the writing of the step's files is not timed) with their
ratio. The machine is shared: the two sides alternate, commit by commit.

    python bench/commit_listing.py                             # 300 kept steps, 20,000 set-aside files
    python bench/commit_listing.py --kept 30 --aside-files 500 --commits 5   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.checkpoint.manifest import (
    MANIFEST_NAME, TRAINER_STATE_NAME, FileRecord, Manifest, parse_step_dirname, shard_basename, step_dirname,
)
from resilient_rl.testing.checkpoint_store import listings

KEEP_EVERY = 1000
KEEP_LAST = 2
SHARD_BYTES = 256


class WalkingManager(CheckpointManager):
    """The baseline: committed steps found in a walk of every file of the run (and a listing of
    its names), for the set-aside check and again for retention, rather than retention taking the
    commit's list: the listings a commit made before."""

    def committed_steps(self, entries=None) -> list[int]:
        if entries is None:  # else the commit has just listed the names
            self.storage.ls(self.run_name)
        found = self.storage.find(self.run_name)
        return sorted(s for s in {parse_step_dirname(path.partition("/")[0]) for path in found
                                  if path.partition("/")[2] == MANIFEST_NAME} if s is not None)

    def apply_retention(self, committed=None) -> list[int]:
        return super().apply_retention()


def _write(path: str, data: bytes) -> FileRecord:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return FileRecord(os.path.basename(path), len(data), hashlib.sha256(data).hexdigest())


def write_step(step_dir: str, step: int, ranks: int) -> list[FileRecord]:
    """The actor's shard pairs of ``ranks`` ranks (their records, relative to the role folder) and
    a trainer state, as a commit expects them (plain writes: building the run is not measured)."""
    records = [_write(os.path.join(step_dir, "actor", shard_basename(rank) + suffix), os.urandom(SHARD_BYTES))
               for rank in range(ranks) for suffix in (".safetensors", ".json")]
    _write(os.path.join(step_dir, TRAINER_STATE_NAME), json.dumps({"step": step}).encode())
    return records


def build_run(root: str, kept: int, ranks: int, aside_files: int) -> int:
    """Write the run ``run`` under ``root``; returns the newest committed step."""
    run = os.path.join(root, "run")
    for i in range(1, kept + 1):
        step = i * KEEP_EVERY
        step_dir = os.path.join(run, step_dirname(step))
        records = [rec.with_prefix("actor") for rec in write_step(step_dir, step, ranks)]
        state = open(os.path.join(step_dir, TRAINER_STATE_NAME), "rb").read()
        records.append(FileRecord(TRAINER_STATE_NAME, len(state), hashlib.sha256(state).hexdigest()))
        manifest = Manifest(step=step, files=tuple(records), world_sizes={"actor": ranks})
        _write(os.path.join(step_dir, MANIFEST_NAME), manifest.to_bytes())
    _write(os.path.join(run, "latest"), step_dirname(kept * KEEP_EVERY).encode())
    per_step = 2 * ranks + 2
    for n in range(aside_files):  # two timelines set aside, each of whole steps
        timeline, step, file = n % 2, n // (2 * per_step), (n // 2) % per_step
        _write(os.path.join(run, "abandoned", f"20250101T00000{timeline}Z-00000{timeline}",
                            step_dirname(kept * KEEP_EVERY + 1 + step), "actor", f"file_{file:05d}"), b"x" * 64)
    return kept * KEEP_EVERY


def commit_once(manager: CheckpointManager, step: int, ranks: int) -> float:
    records = write_step(os.path.join(manager.storage.root, "run", step_dirname(step)), step, ranks)
    t0 = time.perf_counter()
    manager.commit(step, {"actor": records}, {"actor": ranks})
    return time.perf_counter() - t0


def describe(calls: list[tuple[str, str]]) -> str:
    return ", ".join(f"{kind} {path}" for kind, path in calls)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kept", type=int, default=300, help="committed steps kept in the run")
    p.add_argument("--ranks", type=int, default=4, help="actor ranks: two shard files each per step")
    p.add_argument("--aside-files", type=int, default=20_000, help="files under abandoned/")
    p.add_argument("--commits", type=int, default=15, help="commits timed on each side")
    p.add_argument("--dir", default=None, help="where the runs are written (a temporary folder in it)")
    args = p.parse_args(argv)
    if args.kept < 1 or args.ranks < 1 or args.commits < 1 or args.aside_files < 0:
        p.error("--kept, --ranks and --commits must be >= 1, --aside-files >= 0")
    base = tempfile.mkdtemp(prefix="rrl-commit-listing-", dir=args.dir)
    try:
        newest = build_run(os.path.join(base, "template"), args.kept, args.ranks, args.aside_files)
        sides = {}
        for name, cls in (("baseline", WalkingManager), ("this code", CheckpointManager)):
            shutil.copytree(os.path.join(base, "template"), os.path.join(base, name))
            sides[name] = cls(os.path.join(base, name), "run", keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
        times: dict[str, list[float]] = {name: [] for name in sides}
        calls: dict[str, list[tuple[str, str]]] = {}
        for k in range(1, args.commits + 1):
            for name, manager in sides.items():
                with listings(manager.storage) as seen:
                    times[name].append(commit_once(manager, newest + k, args.ranks))
                calls[name] = seen
        committed = {name: m.committed_steps() for name, m in sides.items()}
        assert committed["baseline"] == committed["this code"], "both sides keep the same steps"
        print(f"run: {args.kept} kept steps of {2 * args.ranks + 2} files, {args.aside_files} files under "
              f"abandoned/; {args.commits} commits on each side ({len(committed['this code'])} steps kept)")
        for name in sides:
            print(f"  {name:>9}: {statistics.median(times[name]) * 1e3:8.2f} ms per commit; "
                  f"listings: {describe(calls[name])}")
        ratio = statistics.median(times["baseline"]) / statistics.median(times["this code"])
        print(f"  baseline / this code: {ratio:.1f}x (load average {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
