"""recovery.snapshot_every=auto (trainer/snapshot_sizing.py, workers/snapshots/node_capacity.py): every step in
node memory where each node's tmpfs, RAM and cgroup limit hold the rings with headroom; less often,
in process memory and the object store, where the tmpfs cannot; off where memory cannot; one line
that says which and why."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from resilient_rl.config import load_config
from resilient_rl.errors import ConfigError
from resilient_rl.workers.snapshots.sizing import FALLBACK_EVERY, HEADROOM, decide
from resilient_rl.workers.snapshots import node_capacity

MiB, GiB = 2**20, 2**30


def report(node="n1", actor=100 * MiB, tmpfs_free=10 * GiB, mem=64 * GiB, cgroup=None, tmpfs_size=None, kept=0):
    return {"node": node, "bytes": {"actor": actor},
            "room": {"dir": "/dev/shm", "tmpfs_free": tmpfs_free, "tmpfs_size": tmpfs_size or tmpfs_free,
                     "mem_available": mem, "cgroup_free": cgroup, "reclaimable": kept}}


def test_every_step_in_node_memory_when_every_node_holds_its_rings():
    d = decide([report("n1"), report("n1"), report("n2")], keep=2, node_dir="/dev/shm")
    assert (d.every, d.node_memory) == (1, True)
    assert d.line.startswith("recovery.snapshot_every=auto: every step, in node memory")
    # The formula with its numbers: headroom x copies x bytes per node (the busiest node: two ranks).
    assert f"{HEADROOM:g} x 2 copies x 200.0 MiB per node = 600.0 MiB" in d.line, d.line


def test_docker_default_shm_falls_back_to_process_memory_and_says_how_to_enlarge_it():
    d = decide([report(tmpfs_free=64 * MiB, actor=30 * MiB)], keep=2, node_dir="/dev/shm")
    assert (d.every, d.node_memory) == (FALLBACK_EVERY, False)
    assert "/dev/shm on node n1 has 64.0 MiB free" in d.line and "the rings need 90.0 MiB" in d.line
    assert "--shm-size" in d.line and "medium: Memory" in d.line


def test_a_cgroup_limit_or_little_ram_turns_snapshots_down_or_off():
    # The tmpfs is large, but its pages count against the container's limit.
    d = decide([report(actor=1 * GiB, cgroup=2 * GiB)], keep=2, node_dir="/dev/shm")
    assert (d.every, d.node_memory) == (0, False) and d.line.startswith("recovery.snapshot_every=auto: off")
    d = decide([report(actor=1 * GiB, cgroup=4 * GiB)], keep=2, node_dir="/dev/shm")
    assert (d.every, d.node_memory) == (1, True), d.line
    assert "cgroup free 4096.0 MiB" in d.line
    d = decide([report(actor=1 * GiB, mem=2 * GiB)], keep=2, node_dir="/dev/shm")
    assert d.every == 0


def test_memory_kept_for_a_gone_controllers_next_one_counts_as_room_a_ring_may_take():
    # 100 MiB free of the tmpfs and of RAM; the rings need 1.5 x 2 x 40 = 120 MiB.
    d = decide([report(actor=40 * MiB, tmpfs_free=100 * MiB, mem=100 * MiB)], keep=2, node_dir="/dev/shm")
    assert d.every == 0
    d = decide([report(actor=40 * MiB, tmpfs_free=100 * MiB, mem=100 * MiB, kept=30 * MiB)], keep=2,
               node_dir="/dev/shm")
    assert (d.every, d.node_memory) == (1, True), d.line
    assert "30.0 MiB kept there for the next controllers of runs whose controller is gone" in d.line
    # Not where a cgroup limit is what is short: the kept pages may be charged to another cgroup.
    d = decide([report(actor=40 * MiB, cgroup=100 * MiB, kept=1 * GiB)], keep=2, node_dir="/dev/shm")
    assert not d.node_memory


def test_one_small_node_decides_for_the_run():
    d = decide([report("n1"), report("n2", tmpfs_free=50 * MiB)], keep=2, node_dir="/dev/shm")
    assert d.every == FALLBACK_EVERY and "node n2" in d.line


def test_no_node_directory():
    d = decide([report()], keep=2, node_dir="")
    assert (d.every, d.node_memory) == (FALLBACK_EVERY, False) and "snapshot_node_dir is empty" in d.line


def test_node_room_is_read_from_statvfs_and_the_cgroup(tmp_path):
    st = SimpleNamespace(f_bavail=16, f_frsize=4 * MiB, f_blocks=16)
    files = {"/sys/fs/cgroup/memory.max": "8589934592", "/sys/fs/cgroup/memory.current": "1073741824"}
    room = node_capacity.measure(str(tmp_path / "resilient-rl-x" / "node"), statvfs=lambda p: st,
                                 read=files.get, mem_available=lambda: 3 * GiB, reclaimable=lambda d: 5 * MiB)
    assert room == {"dir": str(tmp_path / "resilient-rl-x" / "node"), "tmpfs_free": 64 * MiB, "tmpfs_size": 64 * MiB,
                    "mem_available": 3 * GiB, "cgroup_free": 7 * GiB, "reclaimable": 5 * MiB}
    assert node_capacity.cgroup_free({"/sys/fs/cgroup/memory.max": "max"}.get) is None
    v1 = {"/sys/fs/cgroup/memory/memory.limit_in_bytes": str(2**63 - 4096),
          "/sys/fs/cgroup/memory/memory.usage_in_bytes": "5"}
    assert node_capacity.cgroup_free(v1.get) is None  # v1's "no limit"
    assert node_capacity.measure("", mem_available=lambda: 1)["tmpfs_free"] is None
    assert node_capacity.tmpfs_free(str(tmp_path))[1] > 0  # the real statvfs


def test_config_default_is_auto_and_numbers_still_work():
    assert load_config(None, []).recovery.snapshot_every == "auto"
    assert load_config(None, ["recovery.snapshot_every=0"]).recovery.snapshot_every == 0
    assert load_config(None, ["recovery.snapshot_every=4"]).recovery.snapshot_every == 4
    assert load_config(None, []).recovery.spares == "auto"  # sized at start (runtime/spare_sizing.py)
    with pytest.raises(ConfigError, match="recovery.snapshot_every"):
        load_config(None, ["recovery.snapshot_every=sometimes"])


def test_keeper_sizes_once_after_a_step_and_logs_one_line(caplog):
    from resilient_rl.testing.snapshot_keeper import FakeGroup, FakeRoles, Ref, fake_get, fake_wait
    from resilient_rl.workers.snapshots.keeper import SnapshotKeeper

    class Sized(FakeGroup):
        def __init__(self, n, role, nbytes, room):
            super().__init__(n, role)
            self.nbytes, self.room, self.asked = nbytes, room, 0

        def execute_rank_async(self, rank, method, *args):
            if method != "snapshot_sizing":
                return super().execute_rank_async(rank, method, *args)
            self.asked += 1
            return Ref({"node": "n1", "bytes": {role: self.nbytes for role in args[0]}, "room": self.room})

    small = {"dir": "/dev/shm", "tmpfs_free": 64 * MiB, "tmpfs_size": 64 * MiB, "mem_available": 8 * GiB,
             "cgroup_free": None}
    g = Sized(2, "actor", 40 * MiB, small)
    cfg = SimpleNamespace(snapshot_every="auto", max_task_retries=0, call_timeout_s=10.0, snapshot_node_dir="/dev/shm",
                          snapshot_hand_over_s=600.0)
    k = SnapshotKeeper(cfg, wait=fake_wait, get=fake_get, run_key="run")
    assert not k.due(1)
    roles = FakeRoles(g)
    with caplog.at_level("INFO", logger="resilient_rl.workers.snapshots.keeper"):
        k.size(roles)
        k.size(roles)
    assert g.asked == 2  # once per process, once per run
    lines = [r.getMessage() for r in caplog.records if "snapshot_every=auto" in r.getMessage()]
    assert len(lines) == 1 and f"every {FALLBACK_EVERY} steps" in lines[0], lines
    assert k.every == FALLBACK_EVERY and k.due(FALLBACK_EVERY) and not k.due(1)
    snap = k.take(roles, FALLBACK_EVERY, {"step": FALLBACK_EVERY})
    assert snap.node == {"actor": [None, None]}  # not in node memory: process memory and the object store
    assert all(t is not None for t in snap.takes["actor"])
    assert os.path.basename(os.path.dirname(k.node_dir)) == "shm"
