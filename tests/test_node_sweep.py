"""Nothing left in node memory that no run will use (workers/snapshots/node_sweep.py): a sweep removes
the snapshot directories and reduction segments whose owner process is gone, whatever the run, at
once where they hold no snapshot; one that holds a snapshot is kept for its run's next controller
for the owner's keep, unless a live run needs the room; what a sweep cannot check (an owner on
another host) is left to the age rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from resilient_rl.config import load_config
from resilient_rl.errors import ConfigError
from resilient_rl.workers.snapshots import node_memory, node_sweep
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


def test_a_run_whose_controller_is_gone_with_no_snapshot_is_removed_at_once_whatever_the_run(tmp_path):
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


def left_with_a_snapshot(root, name: str, owner: dict | None, nbytes: int = 4096) -> str:
    """A run directory as a controller that is gone left it: one node's committed slot, no process
    holding its ``.alive`` lock."""
    run = root / f"{PREFIX}{name}"
    node = run / "node0"
    node.mkdir(parents=True)
    (node / ".alive").write_bytes(b"")
    (node / "actor-0-0.data").write_bytes(b"\0" * nbytes)
    (node / "actor-0-0.meta").write_bytes(b"{}")
    if owner is not None:
        (run / node_sweep.OWNER_FILE).write_text(json.dumps(owner))
    return str(run)


def test_a_gone_controllers_snapshot_is_kept_for_its_next_controller_for_the_owners_keep(tmp_path):
    kept = left_with_a_snapshot(tmp_path, "preempted-aaaa", {**dead_owner(), "keep_s": 300.0})
    unkept = left_with_a_snapshot(tmp_path, "killed-bbbb", {**dead_owner(), "keep_s": 0.0})
    older = left_with_a_snapshot(tmp_path, "older-cccc", {k: v for k, v in dead_owner().items() if k != "keep_s"})
    assert node_sweep.holds_snapshot(kept) and not node_sweep.holds_snapshot(str(tmp_path / "nothing"))
    now = time.time() + 1
    for d in (kept, os.path.join(kept, "node0"), older, os.path.join(older, "node0")):
        os.utime(d, (now - 1, now - 1))
    assert node_sweep.sweep_runs(str(tmp_path), now=now) == [unkept]
    assert node_sweep.sweep_runs(str(tmp_path), now=now + 299) == []
    assert node_sweep.sweep_runs(str(tmp_path), now=now + 301) == [kept]
    assert node_sweep.sweep_runs(str(tmp_path), now=now + node_sweep.STALE_S + 1) == [older]  # no keep_s: STALE_S


def test_a_kept_snapshot_in_use_by_a_process_is_not_removed(tmp_path):
    kept = left_with_a_snapshot(tmp_path, "dying-aaaa", {**dead_owner(), "keep_s": 0.0})
    node_memory._hold_alive(os.path.join(kept, "node0"))  # a rank of it still maps it
    try:
        assert node_sweep.sweep_runs(str(tmp_path), now=time.time() + 10, reclaim=True) == []
        assert node_sweep.reclaimable_bytes(str(tmp_path), now=time.time() + 10) == 0
    finally:
        os.close(node_memory._ALIVE.pop(os.path.join(kept, "node0")))
    assert node_sweep.reclaimable_bytes(str(tmp_path), now=time.time() + 10) >= 4096
    assert node_sweep.sweep_runs(str(tmp_path), now=time.time() + 10) == [kept]


def test_a_live_run_that_needs_the_room_takes_what_is_kept_for_a_gone_controller(tmp_path):
    live = left_with_a_snapshot(tmp_path, "live-aaaa", node_sweep.owner_record())
    kept = left_with_a_snapshot(tmp_path, "preempted-bbbb", dead_owner(), nbytes=64 * 1024)
    remote = left_with_a_snapshot(tmp_path, "remote-cccc", {**node_sweep.owner_record(), "host": "elsewhere"})
    mine = str(tmp_path / f"{PREFIX}mine-dddd")
    assert node_sweep.reclaimable_bytes(str(tmp_path)) >= 64 * 1024
    # Enough room: nothing is taken.
    assert node_memory.make_room(mine, 1024, free=lambda d: 10 * 1024) == []
    # Short of it: the kept snapshot goes; the live run's, and the remote one marked in use lately, stay.
    assert node_memory.make_room(mine, 1024, free=lambda d: 1024) == [kept]
    assert os.path.isdir(live) and os.path.isdir(remote)
    # A remote owner's directory not marked in use for MARK_LOST_S: its controller is gone.
    later = time.time() + node_sweep.MARK_LOST_S + 1
    assert node_sweep.sweep_runs(str(tmp_path), keep=mine, now=later) == []  # not stale yet without a need
    assert node_sweep.sweep_runs(str(tmp_path), keep=mine, now=later, reclaim=True) == [remote]
    assert node_sweep.reclaimable_bytes(str(tmp_path), now=later) == 0


def test_a_ring_that_would_leave_its_node_short_takes_the_room_before_it_reserves_it(tmp_path, monkeypatch):
    from resilient_rl.workers.snapshots import node_capacity

    kept = left_with_a_snapshot(tmp_path, "preempted-aaaa", dead_owner())
    files = NodeFiles(str(tmp_path / f"{PREFIX}live-bbbb" / "node0"), "actor", 0, node_sweep.owner_record())
    files.map(0, 1024)
    assert os.path.isdir(kept)  # room enough: kept for its run's next controller
    monkeypatch.setattr(node_capacity, "free_bytes", lambda d: 1024)
    files.map(1, 1024)
    assert not os.path.exists(kept)


def test_a_reservation_that_finds_no_space_takes_the_room_and_tries_again(tmp_path, monkeypatch):
    """Another process of the node reserved its slot between the measure and this reservation, or
    removed the kept snapshot itself, whose pages the kernel frees a moment after its name."""
    import errno

    kept = left_with_a_snapshot(tmp_path, "preempted-aaaa", dead_owner())
    files = NodeFiles(str(tmp_path / f"{PREFIX}live-bbbb" / "node0"), "actor", 0, node_sweep.owner_record())
    real, calls = os.posix_fallocate, []

    def fallocate(fd, offset, length):
        calls.append(os.path.exists(kept))
        if len(calls) <= 2:  # the second: the pages of the removed snapshot are not free yet
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    assert files.map(0, 1024).numel() == 1024
    assert calls == [True, False, False]  # the kept snapshot was removed before the second try


def test_a_reservation_that_still_finds_no_space_says_where_the_room_went(tmp_path, monkeypatch):
    """The error names the request, the free and total bytes, this run's files, the other files
    there and the rest: on a tmpfs of its own, removed files that a process still maps."""
    import errno
    from types import SimpleNamespace

    from resilient_rl.workers.snapshots import node_capacity

    other = tmp_path / f"{PREFIX}other-cccc" / "node0"
    other.mkdir(parents=True)
    (other / "actor-0-0.data").write_bytes(b"\1" * 2**20)
    files = NodeFiles(str(tmp_path / f"{PREFIX}live-bbbb" / "node0"), "actor", 0, node_sweep.owner_record())
    files.map(1, 2**19)  # this run's half MiB
    mib = 2**20 // 4096
    fs = SimpleNamespace(f_frsize=4096, f_blocks=64 * mib, f_bfree=60 * mib, f_bavail=60 * mib)
    monkeypatch.setattr(node_capacity.os, "statvfs", lambda path: fs)
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "no space")))
    monkeypatch.setattr(node_capacity.os.path, "ismount", lambda path: path == str(tmp_path))
    monkeypatch.setattr(node_memory, "RESERVE_WAIT_S", 0.2)  # it tries again for that long, then says why
    with pytest.raises(OSError) as err:
        files.map(0, 3 * 2**20)
    assert err.value.errno == errno.ENOSPC
    assert str(err.value).endswith(f"no space: reserving 3.0 MiB in {tmp_path / (PREFIX + 'live-bbbb')}: 60.0 MiB "
                                   "free of 64.0 MiB; this run's files hold 0.5 MiB, other files there 1.0 MiB, "
                                   "and 2.5 MiB is held by removed files (still open or mapped, or being freed)"), \
        str(err.value)
    assert not os.path.exists(files._path(0, "data"))  # nothing half-reserved is left
    monkeypatch.setattr(node_capacity.os.path, "ismount", lambda path: False)
    assert node_capacity.room_report(os.path.dirname(files.dir), 2**20).endswith(
        "and 2.5 MiB is used by the rest of that file system")


def test_the_processes_holding_removed_files_are_named_with_their_bytes(tmp_path):
    """A file removed while mapped (a ring's old slot) or open keeps its pages: the report names
    the process and what it holds."""
    import torch

    from resilient_rl.workers.snapshots import node_capacity

    mapped, opened = tmp_path / "mapped.data", tmp_path / "opened.data"
    mapped.write_bytes(b"\0" * 2**20)
    opened.write_bytes(b"\0" * 3 * 2**19)
    view = torch.from_file(str(mapped), shared=True, size=2**20, dtype=torch.uint8)
    with open(opened, "rb") as f:
        assert node_capacity.removed_file_holders(str(tmp_path)) == []  # nothing removed yet
        mapped.unlink()
        opened.unlink()
        held = node_capacity.removed_file_holders(str(tmp_path))
        assert [(pid, n) for pid, _, n in held] == [(os.getpid(), 2**20 + 3 * 2**19)], held
        assert not f.closed
    del view
    assert node_capacity.removed_file_holders(str(tmp_path)) == []


def test_a_controllers_sweeps_mark_its_directory_in_use_and_run_every_minute(tmp_path):
    remote = left_with_a_snapshot(tmp_path, "remote-aaaa", {**node_sweep.owner_record(), "host": "elsewhere"})
    long_ago = time.time() - 2 * node_sweep.STALE_S
    for d in (remote, os.path.join(remote, "node0")):
        os.utime(d, (long_ago, long_ago))
    # Its own sweep marks it in use: another node's sweep keeps it.
    assert node_sweep.sweep_node(str(tmp_path), keep=remote, shm_dir=str(tmp_path / "no-shm")) == []
    assert node_sweep.sweep_runs(str(tmp_path)) == []
    calls, t = [], [0.0]
    sweeps = node_sweep.NodeSweeps("/root", "/root/mine", "/shm", every_s=60.0, clock=lambda: t[0],
                                   sweep=lambda *a: calls.append(a))
    sweeps.maybe()
    assert calls == []  # none before the start's
    sweeps.now()
    t[0] = 59.0
    sweeps.maybe()
    t[0] = 60.0
    sweeps.maybe()
    assert calls == [("/root", "/root/mine", "/shm")] * 2


def test_the_keep_is_the_runs_config_and_goes_into_its_owner_record(tmp_path):
    from resilient_rl.testing.snapshot_keeper import keeper

    assert load_config(None, []).recovery.snapshot_hand_over_s == 600.0
    assert load_config(None, ["recovery.snapshot_hand_over_s=0"]).recovery.snapshot_hand_over_s == 0
    with pytest.raises(ConfigError, match="recovery.snapshot_hand_over_s"):
        load_config(None, ["recovery.snapshot_hand_over_s=-1"])
    k = keeper(node_dir=str(tmp_path))
    assert k.owner["keep_s"] == 600.0 and node_sweep.keep_for(k.owner) == 600.0


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
