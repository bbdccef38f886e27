"""Nothing left in node memory (workers/snapshots/node_sweep.py): every start removes the snapshot directories
and reduction segments whose owner process is gone, whatever the run, at once; what it cannot
check (an owner on another host) is left to the age rule."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from resilient_rl.workers.snapshots import node_sweep
from resilient_rl.workers.snapshots.node_memory import NodeFiles, PREFIX

from test_snapshot_copy import Rank, mlp


def dead_owner() -> dict:
    """The owner record of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    record = node_sweep.owner_record(proc.pid)
    proc.wait()
    return record


def run_dir(root, name: str, owner: dict | None) -> str:
    files = NodeFiles(str(root / f"{PREFIX}{name}" / "node0"), "actor", 0, owner)
    files.map(0, 64)
    return os.path.dirname(files.dir)


def test_a_run_whose_controller_is_gone_is_removed_at_once_whatever_the_run(tmp_path):
    live = run_dir(tmp_path, "live-run-bbbb", node_sweep.owner_record())
    foreign = run_dir(tmp_path, "remote-run-cccc", {**node_sweep.owner_record(), "host": "elsewhere", "pid": 1})
    unknown = run_dir(tmp_path, "old-format-dddd", None)
    gone = run_dir(tmp_path, "other-run-aaaa", dead_owner())  # fresh, and this process holds its .alive
    removed = node_sweep.sweep_node(str(tmp_path), keep=None, shm_dir=str(tmp_path / "no-shm"))
    assert removed == [gone]
    assert not os.path.exists(gone) and all(os.path.isdir(d) for d in (live, foreign, unknown))
    assert node_sweep.owner_alive(node_sweep.read_owner(foreign)) is None


def test_a_new_run_directory_sweeps_its_dead_neighbours(tmp_path):
    gone = run_dir(tmp_path, "crashed-eeee", dead_owner())
    rank = Rank(mlp)
    rank.snapshots.take_snapshot(1, None, {"dir": str(tmp_path / f"{PREFIX}new-ffff"), "id": "1.1",
                                 "owner": node_sweep.owner_record()})
    assert not os.path.exists(gone)
    assert node_sweep.read_owner(str(tmp_path / f"{PREFIX}new-ffff")) == node_sweep.owner_record()


def test_reduction_segments_of_dead_creators_are_removed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = tmp_path / f"rrl-reduce-{proc.pid}-abc"
    dead_fifo = tmp_path / f"rrl-reduce-{proc.pid}-abc.r0"
    mine = tmp_path / f"rrl-reduce-{os.getpid()}-def"
    reused = tmp_path / f"rrl-reduce-{os.getpid()}-old"  # made before this process started: pid reused
    other = tmp_path / "unrelated"
    for p in (dead, mine, reused, other):
        p.write_bytes(b"x")
    os.mkfifo(dead_fifo)
    long_ago = time.time() - 10 * 365 * 86400
    os.utime(reused, (long_ago, long_ago))
    removed = node_sweep.sweep_reduce_segments(str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in (dead, dead_fifo, reused))
    assert mine.exists() and other.exists()


def test_reduction_segment_names_carry_their_creator(tmp_path, monkeypatch):
    from resilient_rl.workers import shm_reduce

    monkeypatch.setattr(shm_reduce, "SHM_DIR", str(tmp_path))
    name, paths = shm_reduce._create(1024, 2)
    try:
        assert name.startswith(f"rrl-reduce-{os.getpid()}-")
        assert node_sweep.sweep_reduce_segments(str(tmp_path)) == []  # its creator runs
    finally:
        for p in paths:
            os.unlink(p)
