"""Verified, private snapshots (workers/snapshots/take.py, workers/snapshots/meta.py, workers/snapshots/node_memory.py):
every copy is checksummed on the "snapshot" thread and checked before it is written into a rank;
node memory is private (0700/0600) and its metadata JSON (nothing is unpickled); a slot a reader
still maps is never written again in place."""

from __future__ import annotations

import json
import os
import pickle
import stat

import numpy as np
import torch

from resilient_rl.workers.snapshots import meta
from resilient_rl.workers.snapshots.node_memory import NodeCopy, NodeFiles, node_path

from test_snapshot_copy import Rank, assert_same, mlp


def take(rank: Rank, step: int, run_dir: str, snap_id: str) -> dict:
    answer = rank.snapshots.take_snapshot(step, None, {"dir": run_dir, "id": snap_id})
    rank.snapshots.seal_snapshot(step)
    return answer


def flip(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_flipped_bytes_in_node_memory_are_detected_and_never_restored(tmp_path):
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    take(rank, 1, run_dir, "1.1")
    flip(os.path.join(node_path(run_dir), "actor-0-0.data"))
    fresh = Rank(mlp)
    fresh.train(5)  # some state of its own, which a refused copy must leave as it is
    before = fresh.fingerprint()
    answer = fresh.snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1"))
    assert isinstance(answer, dict) and "does not match" in answer["corrupt"], answer
    assert_same(fresh.fingerprint(), before)
    assert not fresh.snapshots.has_snapshot(1)


def test_a_damaged_own_or_handed_over_copy_is_refused():
    rank = Rank(mlp)
    rank.train(0)
    copy = rank.snapshot(1)["roles"]["actor"]  # taken, sealed and published
    assert copy["checksum"].startswith("xxh3_64_pieces:")
    other = Rank(mlp)
    other.train(3)
    before = other.fingerprint()
    bad = dict(copy, data=copy["data"].copy())
    bad["data"][7] ^= 1
    assert "corrupt" in other.snapshot_restorer.load_snapshot(1, bad)
    assert_same(other.fingerprint(), before)
    assert other.snapshot_restorer.load_snapshot(1, copy) is True
    # The rank's own copy, damaged in its ring: refused too.
    rank.train(1)
    rank.snapshots.own[1][1]["data"][3] ^= 1
    assert "corrupt" in rank.snapshot_restorer.load_snapshot(1)


def test_a_copy_its_process_left_unsealed_is_loaded_from_node_memory_as_written(tmp_path):
    """The take commits its copy in node memory before any checksum (the seal commits it again
    with one): a process killed between its take and its seal leaves a whole copy that its new
    process loads, answering "unsealed". Anywhere else a copy without a checksum is refused, and
    a copy whose take never finished was never committed."""
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    rank.snapshots.take_snapshot(1, None, {"dir": run_dir, "id": "1.1"})
    with open(os.path.join(node_path(run_dir), "actor-0-0.meta"), "rb") as f:
        assert "checksum" not in f.read().decode()
    fresh = Rank(mlp)
    assert fresh.snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1")) == "unsealed"
    assert_same(fresh.fingerprint(), rank.fingerprint())
    assert "no xxh3_64_pieces checksum" in rank.snapshot_restorer.load_snapshot(1)["corrupt"]
    files = NodeFiles(node_path(run_dir), "actor", 0)
    files.invalidate(files.find(2, 1, "1.1")[0])  # what a take does before writing a slot again
    assert Rank(mlp).snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1")) is False


def test_node_memory_is_private_and_its_metadata_is_json(tmp_path):
    old = os.umask(0o022)
    try:
        run_dir = str(tmp_path / "resilient-rl-run1")
        rank = Rank(mlp)
        rank.train(0)
        take(rank, 1, run_dir, "1.1")
    finally:
        os.umask(old)
    node = node_path(run_dir)
    for d in (run_dir, node):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for name in os.listdir(node):
        assert stat.S_IMODE(os.stat(os.path.join(node, name)).st_mode) == 0o600, name
    with open(os.path.join(node, "actor-0-0.meta"), "rb") as f:
        meta = json.loads(f.read())  # JSON, not a pickle
    assert "values" in meta and "containers" in meta


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch BOOM",))


def test_a_pickled_meta_is_never_unpickled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    take(rank, 1, run_dir, "1.1")
    meta_path = os.path.join(node_path(run_dir), "actor-0-0.meta")
    with open(meta_path, "wb") as f:
        pickle.dump({"step": 1, "id": "1.1", "bytes": 1, "x": _Boom()}, f)
    assert NodeFiles(node_path(run_dir), "actor", 0).find(2, 1, "1.1") is None
    assert Rank(mlp).snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1")) is False
    assert not os.path.exists(tmp_path / "BOOM")


def test_a_slot_still_mapped_by_a_reader_is_not_written_in_place(tmp_path):
    """A process reading a copy from node memory keeps its bytes when the ring maps that slot
    again (a new process of the rank, a slot given a new buffer): the file is replaced, not
    rewritten."""
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    take(rank, 1, run_dir, "1.1")
    files = NodeFiles(node_path(run_dir), "actor", 0)
    slot, meta, reader = files.find(2, 1, "1.1")
    kept = reader.clone()
    rank.snapshots.ring.forget(slot)  # its next use maps the slot afresh
    rank.snapshots.own.clear()
    rank.train(1)
    take(rank, 2, run_dir, "2.2")
    rank.train(2)
    take(rank, 3, run_dir, "3.3")  # both slots written again
    assert torch.equal(reader, kept)
    assert np.array_equal(reader.numpy(), kept.numpy())


def test_a_take_waits_for_the_seal_reading_its_slot(monkeypatch):
    """The seal reads a slot on the "snapshot" thread; a take needing that slot waits for it."""
    import threading

    from resilient_rl.workers.snapshots import meta as snapshot_meta, take as snapshot_mod

    rank = Rank(mlp)
    rank.train(0)
    rank.snapshots.take_snapshot(1)
    rank.snapshots.seal_snapshot(1)
    rank.train(1)
    rank.snapshots.take_snapshot(2)
    rank.snapshots.seal_snapshot(2)
    rank.train(2)
    started, release = threading.Event(), threading.Event()
    real = snapshot_meta.checksum

    def slow(data, nbytes=None):
        started.set()
        release.wait(10)
        return real(data, nbytes)

    monkeypatch.setattr(snapshot_meta, "checksum", slow)
    monkeypatch.setattr(snapshot_mod, "SLOT_WAIT_S", 30.0)
    rank.snapshots.take_snapshot(3)  # into step 1's slot
    before = rank.snapshots.own[3][1]["data"].copy()
    errors = []

    def seal():
        try:
            rank.snapshots.seal_snapshot(3)
        except RuntimeError as exc:  # superseded by step 5 once read: not committed anywhere
            errors.append(exc)

    sealer = threading.Thread(target=seal)
    sealer.start()
    assert started.wait(10)
    rank.train(3)
    rank.snapshots.take_snapshot(4)  # into step 2's slot: no wait
    rank.train(4)
    taker = threading.Thread(target=rank.snapshots.take_snapshot, args=(5,))
    taker.start()  # needs step 3's slot, which the seal is reading
    taker.join(0.5)
    assert taker.is_alive(), "the take wrote the slot the seal is reading"
    assert np.array_equal(before, rank.snapshots.ring.buffers[0].numpy()), "step 3's slot changed while read"
    release.set()
    sealer.join(10)
    taker.join(10)
    assert not taker.is_alive() and rank.snapshots.has_snapshot(5)


def test_a_copy_left_under_another_clusters_node_id_is_found_only_when_asked_for_any_node(tmp_path):
    """A new Ray cluster gives the machine a new node id: a copy an earlier controller's cluster
    left (a preemption with no warning) is under the old one, and a rank finds its own there."""
    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    take(rank, 1, run_dir, "1.1")
    os.rename(node_path(run_dir), os.path.join(run_dir, "node-of-the-previous-cluster"))
    fresh = Rank(mlp)
    assert not fresh.snapshot_restorer.node_copy_here(1, NodeCopy(run_dir, "1.1"))
    assert fresh.snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1")) is False
    anywhere = NodeCopy(run_dir, "1.1", any_node=True)
    assert fresh.snapshot_restorer.node_copy_here(1, anywhere) and not fresh.snapshot_restorer.node_copy_here(2, anywhere)
    assert fresh.snapshot_restorer.load_snapshot(1, anywhere) is True
    assert_same(fresh.fingerprint(), rank.fingerprint())


def test_the_checksum_hashes_pieces_on_threads_and_its_value_does_not_depend_on_them(monkeypatch):
    """The checksum is xxh3 over pieces, hashed on several threads: the same value on one thread
    or many, a flipped byte seen in any piece (the last one short), and a checksum of the whole
    bytes in one piece, as copies were sealed before, still checked."""
    monkeypatch.setattr(meta, "PIECE", 1000)
    data = np.random.default_rng(0).integers(0, 256, 4500, dtype=np.uint8)
    monkeypatch.setattr(meta, "THREADS", 1)
    one = meta.checksum(data)
    monkeypatch.setattr(meta, "THREADS", 3)
    assert meta.checksum(data) == one and one.startswith("xxh3_64_pieces:")
    assert meta.checksum(data, 4000) != one  # the first 4,000 bytes only
    for offset in (0, 999, 1000, 4499):
        bad = data.copy()
        bad[offset] ^= 1
        assert "does not match" in meta.verify({"checksum": one, "data": bad, "bytes": 4500}), offset
    assert meta.verify({"checksum": one, "data": data, "bytes": 4500}) is None
    whole = meta.checksum(data, algorithm=meta.WHOLE)
    assert whole.startswith("xxh3_64:") and meta.verify({"checksum": whole, "data": data, "bytes": 4500}) is None
    assert "does not match" in meta.verify({"checksum": whole, "data": data[::-1].copy(), "bytes": 4500})
    unknown = meta.verify({"checksum": "md5:00", "data": data, "bytes": 4500})
    assert unknown == "no xxh3_64_pieces checksum (got 'md5:00')"


def test_a_restore_logs_how_long_its_check_and_its_writing_took(tmp_path, caplog):
    """The restore phase of a recovery is each rank's check and writing of its copy: the rank logs
    both, so that a run shows which of them its restore time went to."""
    import logging

    run_dir = str(tmp_path / "resilient-rl-run1")
    rank = Rank(mlp)
    rank.train(0)
    take(rank, 1, run_dir, "1.1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="resilient_rl.workers.snapshots.restore"):
        assert Rank(mlp).snapshot_restorer.load_snapshot(1, NodeCopy(run_dir, "1.1")) is True
        assert rank.snapshot_restorer.load_snapshot(1) is True
    lines = [r.getMessage() for r in caplog.records if "GB: checked in" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("actor rank 0: restored step 1 from its node copy, ") and ", written in " in lines[0]
    assert lines[1].startswith("actor rank 0: restored step 1 from its own copy, ")
