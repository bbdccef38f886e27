"""Snapshots in node memory (workers/snapshots/node_memory.py): a rank's ring as files that outlive its
process; a new process of the same rank reads its copy back bit for bit; the commit marker; a
directory too small falls back to process memory; stale run directories are swept."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from resilient_rl import page_lock
from resilient_rl.testing.fake_cudart import FakeCudart
from resilient_rl.workers.snapshots import node_memory
from resilient_rl.workers.snapshots.node_memory import NodeCopy, NodeFiles, node_path
from resilient_rl.workers.snapshots.node_sweep import STALE_S, sweep_runs

from test_snapshot_copy import Rank, assert_same, mlp


def take(rank: Rank, step: int, run_dir: str, snap_id: str) -> dict:
    """Take and seal (checksum, commit in node memory) as the controller asks a process."""
    answer = rank.snapshots.take_snapshot(step, None, {"dir": run_dir, "id": snap_id})
    rank.snapshots.seal_snapshot(step)
    return answer


def test_a_new_process_of_the_rank_loads_the_copy_its_predecessor_left(tmp_path):
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    for s in range(2):
        rank.train(s)
    answer = take(rank, 2, run_dir, "2.1")
    assert answer["node_failed"] == {}
    at_snapshot = rank.fingerprint()
    files = sorted(os.listdir(node_path(run_dir)))
    assert files == [".alive", "actor-0-0.data", "actor-0-0.meta"]
    rank.train(2)
    noise_a = rank.train(3)
    after_a = rank.fingerprint()
    del rank  # the process is gone; its copy is not

    fresh = Rank(mlp)
    assert fresh.snapshot_restorer.load_snapshot(2, NodeCopy(run_dir, "2.1")) is True
    assert_same(fresh.fingerprint(), at_snapshot)
    fresh.train(2)
    assert torch.equal(fresh.train(3), noise_a)
    assert_same(fresh.fingerprint(), after_a)
    # The copy became the new process's own (its ring slot); its next take writes the other slot.
    assert fresh.snapshots.has_snapshot(2)
    take(fresh, 4, run_dir, "4.2")
    assert sorted(os.listdir(node_path(run_dir)))[1:] == ["actor-0-0.data", "actor-0-0.meta",
                                                          "actor-0-1.data", "actor-0-1.meta"]


def test_only_the_snapshot_asked_for_is_read(tmp_path):
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    take(rank, 1, run_dir, "1.1")
    fresh = Rank(mlp)
    assert fresh.snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.9")) is False  # another timeline's step 1
    assert fresh.snapshot_restorer.load_snapshot(2, NodeCopy(run_dir, "1.1")) is False  # another step
    assert fresh.snapshot_restorer.load_snapshot(1, NodeCopy(str(tmp_path / "resilient-rl-other"), "1.1")) is False
    other_rank = Rank(mlp)
    other_rank.rank = 1
    assert other_rank.snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1")) is False  # rank 0's files are not its


def test_a_slot_being_written_is_withdrawn_first(tmp_path):
    """A process that dies while copying into a slot leaves that slot without a commit marker:
    its older snapshot there is no longer offered, the other slot's still is."""
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    take(rank, 1, run_dir, "1.1")
    rank.train(0)
    take(rank, 2, run_dir, "2.2")
    rank.train(1)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed during the copy")

    rank.snapshots.ring.copy_out = dies
    with pytest.raises(KeyboardInterrupt):
        take(rank, 3, run_dir, "3.3")  # reuses step 1's slot
    files = NodeFiles(node_path(run_dir), "actor", 0)
    assert files.find(2, 1, "1.1") is None
    assert files.find(2, 2, "2.2") is not None


def test_no_space_in_node_memory_keeps_copies_in_the_process(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "resilient-rl-run1")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    rank = Rank(mlp)
    answer = take(rank, 1, run_dir, "1.1")
    assert "No space left on device" in answer["node_failed"]["actor"]
    assert rank.snapshots.ring.files is None and rank.snapshots.has_snapshot(1)
    assert not [f for f in os.listdir(node_path(run_dir)) if f.endswith(".data")]  # no sparse file left
    _, copies = rank.snapshots.publish_snapshot(1)
    assert copies["roles"]["actor"]["step"] == 1
    # Later takes for the same run do not try again; the copy loads back from the process.
    assert take(rank, 2, run_dir, "2.2")["node_failed"]
    rank.train(0)
    assert rank.snapshot_restorer.load_snapshot(2) is True


def test_run_directories_of_owners_that_cannot_be_checked_are_swept_once_stale_unless_in_use(tmp_path):
    root = tmp_path
    live = NodeFiles(str(root / "resilient-rl-live" / "n0"), "actor", 0)
    live.map(0, 64)  # this process holds its .alive lock
    dead = root / "resilient-rl-dead" / "n0"
    dead.mkdir(parents=True)
    (dead / ".alive").write_bytes(b"")
    (dead / "actor-0-0.data").write_bytes(b"x" * 64)
    (root / "resilient-rl-unmarked" / "n0").mkdir(parents=True)  # no process ever locked it
    (root / "unrelated").mkdir()
    later = time.time() + 2 * STALE_S
    removed = sweep_runs(str(root), keep=str(root / "resilient-rl-mine"), now=later)
    assert sorted(removed) == [str(root / "resilient-rl-dead"), str(root / "resilient-rl-unmarked")]
    assert (root / "resilient-rl-live").exists() and (root / "unrelated").exists()
    # Recently changed: kept whoever uses it.
    (root / "resilient-rl-x" / "n0").mkdir(parents=True)
    assert sweep_runs(str(root), keep="", now=time.time()) == []


def test_node_buffers_are_page_locked_for_device_copies(tmp_path):
    files = NodeFiles(str(tmp_path / "resilient-rl-r" / "n0"), "actor", 0)
    buf = files.map(0, 4096)
    ok = FakeCudart()
    assert page_lock.pin(buf, ok, [ok]) is True and ok.registered == [(buf.data_ptr(), 4096, 0)]
    page_lock.unpin(buf, ok, [ok])
    assert ok.registered == [] and ok.last_error == 0


def test_a_refused_page_lock_leaves_no_cuda_error_behind(tmp_path):
    """CUDA keeps a failed call's error until it is read, and torch reads it after its next
    kernel launch: a refusal left pending would fail the next step's first kernel."""
    buf = NodeFiles(str(tmp_path / "resilient-rl-r" / "n0"), "actor", 0).map(0, 4096)
    refused = FakeCudart(code=712)  # cudaErrorHostMemoryAlreadyRegistered
    other = FakeCudart()
    other.last_error = 2  # a second runtime library of the process: its error is consumed too
    assert page_lock.pin(buf, refused, [refused, other]) is False  # pageable, still correct
    assert refused.last_error == 0 and other.last_error == 0
    page_lock.unpin(buf, refused, [refused])  # never registered: refused too, and consumed
    assert refused.last_error == 0


def test_the_cuda_runtimes_of_the_process_are_found_in_its_maps():
    maps = "\n".join([
        "7f00-7f10 r-xp 00000000 08:01 11 /venv/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
        "7f10-7f20 r--p 00010000 08:01 11 /venv/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
        "7f20-7f30 r-xp 00000000 08:01 12 /venv/site-packages/torch/lib/libcudart-9335f6a2.so.12 (deleted)",
        "7f30-7f40 r-xp 00000000 08:01 13 /venv/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
        "7f40-7f50 rw-p 00000000 00:00 0 ",
        "7f50-7f60 rw-p 00000000 00:00 0 [heap]",
    ])
    assert page_lock.runtime_paths(maps) == ["/venv/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
                                             "/venv/site-packages/torch/lib/libcudart-9335f6a2.so.12"]
    assert page_lock.drain() == []  # this process maps none, or none holds an error


def test_a_new_controller_of_the_run_removes_its_predecessors_node_memory(tmp_path):
    mine = node_memory.run_path(str(tmp_path), "abc123", "new")
    for controller in ("old1", "old2", "new"):
        os.makedirs(os.path.join(node_memory.run_path(str(tmp_path), "abc123", controller), "n0"))
    other_run = node_memory.run_path(str(tmp_path), "abc123x", "c")  # another run's key
    os.makedirs(other_run)
    removed = node_memory.remove_predecessors(mine)
    assert sorted(os.path.basename(p) for p in removed) == ["resilient-rl-abc123-old1", "resilient-rl-abc123-old2"]
    assert sorted(os.listdir(tmp_path)) == ["resilient-rl-abc123-new", "resilient-rl-abc123x-c"]


def test_a_replaced_ring_unregisters_its_page_locked_buffers(tmp_path, monkeypatch):
    from resilient_rl.workers.snapshots.buffers import HostRing

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    ring = HostRing(2, NodeFiles(str(tmp_path / "resilient-rl-r-c" / "n0"), "actor", 0))
    ring.buffer(0, 4096, pin=True)
    ring.buffer(1, 4096, pin=True)
    assert len(cudart.registered) == 2
    ring.forget(0)
    assert len(cudart.registered) == 1
    ring.release()
    assert cudart.registered == []


def test_the_process_memory_ring_page_locks_exactly_the_layouts_size(monkeypatch):
    """torch's pinned allocator rounds up to a power of two (a 19 GiB state locks 32 GiB per
    slot): the ring registers pageable memory of the layout's own size instead."""
    import gc

    from resilient_rl.workers.snapshots.buffers import HostRing

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    nbytes = 3 * 4096 + 64  # far from a power of two
    ring = HostRing(2)
    buf = ring.buffer(0, nbytes, pin=True)
    assert buf.numel() == nbytes and buf.device.type == "cpu"
    assert cudart.registered == [(buf.data_ptr(), nbytes, 0)]
    assert ring.buffer(0, nbytes, pin=True) is buf  # reused, not registered again
    assert len(cudart.registered) == 1

    # A reader's view outlives the ring's hold: the memory is unlocked once the ring lets go.
    reader = ring.buffer(1, nbytes, pin=True).numpy()
    ring.forget(1)
    assert [r[1] for r in cudart.registered] == [nbytes]
    reader[:] = 7  # still valid memory
    del reader
    gc.collect()

    # Dropped without forget: unlocked when the last tensor over it is gone, once.
    calls = []
    monkeypatch.setattr(cudart, "cudaHostUnregister", lambda ptr: calls.append(ptr) or 0)
    ptr = buf.data_ptr()
    del ring, buf
    gc.collect()
    assert calls == [ptr]


def test_a_refused_page_lock_keeps_the_pageable_buffer(monkeypatch):
    from resilient_rl.workers.snapshots.buffers import HostRing

    cudart = FakeCudart(code=712)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    ring = HostRing(1)
    buf = ring.buffer(0, 1000, pin=True)
    assert buf.numel() == 1000
    assert ring.buffer(0, 1000, pin=True) is buf  # not reallocated at every snapshot


def test_a_ring_whose_page_lock_is_refused_keeps_its_pageable_buffer_and_no_cuda_error(tmp_path, monkeypatch):
    from resilient_rl.workers.snapshots.buffers import HostRing

    cudart = FakeCudart(code=2)  # cudaErrorMemoryAllocation: more than the node lets it lock
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(page_lock, "loaded_runtimes", lambda: [cudart])
    for files in (None, NodeFiles(str(tmp_path / "resilient-rl-r-c" / "n0"), "actor", 0)):
        ring = HostRing(1, files)
        buf = ring.buffer(0, 4096, pin=True)
        assert cudart.last_error == 0 and cudart.registered == []
        cudart.code = 0  # not asked again: the slot keeps its pageable buffer
        assert ring.buffer(0, 4096, pin=True) is buf and cudart.registered == []
        ring.release()
        cudart.code = 2
