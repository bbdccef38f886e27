"""The requests that verifying and listing checkpoints make: on an object store each one is a round
trip, so a step's files are hashed side by side, the folders of one depth are listed side by side,
and ``checkpoints list`` reads the step folders and manifests it prints, not the whole run.

Concurrency is shown by a barrier that the first requests must meet together (a sequential loop
would leave the first one waiting alone), never by timings."""

from __future__ import annotations

import threading

import pytest

from resilient_rl.checkpoint import CheckpointManager, FileRecord, Storage
from resilient_rl.checkpoint.inspect import CheckpointLocation, inspect_run, list_checkpoints
from resilient_rl.errors import StorageError
from resilient_rl.testing.checkpoint_store import FAST, faulty_store, save_shard_files

ROLES = ("actor", "critic")


def _meet(fs, kind: str, match, parties: int = 2) -> list[str]:
    """Make the first ``parties`` requests of ``kind`` on paths that ``match`` wait for each other;
    the paths of every such request are returned (a BrokenBarrierError ends one left alone)."""
    barrier = threading.Barrier(parties, timeout=10)
    seen: list[str] = []
    lock = threading.Lock()

    def on_request(k: str, path: str) -> None:
        if k != kind or not match(path):
            return
        with lock:
            seen.append(path)
            first = len(seen) <= parties
        if first:
            barrier.wait()
    fs.on_request = on_request
    return seen


@pytest.mark.parametrize("strategy", ["", "put"])
def test_a_deep_verify_hashes_the_files_of_a_step_side_by_side(strategy):
    url, options, fs = faulty_store(strategy=strategy)
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    save_shard_files(manager, 5, ranks=6)
    reader = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    reads = _meet(fs, "read", lambda path: "/shard_" in path)
    assert reader.verify(5, deep=True) == "ok"
    assert len(reads) == 2 * 2 * 6  # every shard once, the first two at the same time


def test_a_deep_verify_reports_the_first_bad_file_in_manifest_order():
    url, options, fs = faulty_store()
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    save_shard_files(manager, 5, ranks=6)
    for path in ("critic/shard_00004.json", "actor/shard_00002.json"):  # same sizes, other bytes
        full = f"run/step_00000005/{path}"
        data = manager.storage.read_bytes(full)
        manager.storage.write_bytes_atomic(full, data[::-1])
    reader = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    assert reader.verify(5, deep=False) == "ok"
    assert reader.verify(5) == "corrupt: actor/shard_00002.json: sha256 mismatch"


def test_a_deep_verify_retries_transient_reads_and_names_a_file_that_stays_unreadable():
    url, options, fs = faulty_store()
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    save_shard_files(manager, 5, ranks=6)
    fs.plan.transient_reads = fs.reads + 3  # the next three requests fail once each, then pass
    assert CheckpointManager(url, "run", storage_options=options, retry=FAST).verify(5) == "ok"
    fs.plan.outage_reads = "actor/shard_00003.json"
    with pytest.raises(StorageError, match=r"storage read failed for .*/run/step_00000005/actor/"
                                           r"shard_00003\.json: still failing after 5 attempts"):
        CheckpointManager(url, "run", storage_options=options, retry=FAST).verify(5)


def test_a_commit_hashes_the_written_shards_side_by_side():
    url, options, fs = faulty_store(strategy="put")
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    reads = _meet(fs, "read", lambda path: "/shard_" in path)
    files = {"actor": []}
    for rank in range(4):
        for suffix in (".safetensors", ".json"):
            rec = manager.storage.write_bytes_atomic(f"run/step_00000003/actor/shard_{rank:05d}{suffix}",
                                                     b"x" * (rank + 1))
            files["actor"].append(FileRecord(rec.path.rsplit("/", 1)[-1], rec.size, rec.sha256))
    manager.commit(3, files, {"actor": 4})
    assert manager.verify(3, deep=False) == "ok" and len(reads) == 8


def test_the_role_folders_of_a_step_are_listed_side_by_side():
    url, options, fs = faulty_store()  # listed folder by folder, like a file tree
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    save_shard_files(manager, 5, ranks=6)
    listed = _meet(fs, "list", lambda path: path.endswith(ROLES))
    assert manager.verify(5, deep=False) == "ok" and sorted(p.rsplit("/", 1)[-1] for p in listed) == list(ROLES)


def test_the_manifests_of_a_run_are_looked_for_side_by_side():
    url, options, fs = faulty_store(strategy="put")
    manager = CheckpointManager(url, "run", keep_last=5, storage_options=options, retry=FAST)
    for step in (1, 2, 3):
        save_shard_files(manager, step, ranks=1)
    asked = _meet(fs, "info", lambda path: path.endswith("MANIFEST.json"))
    assert manager.committed_steps() == [1, 2, 3] and len(asked) == 3


def _run_with_history(strategy: str):
    url, options, fs = faulty_store(strategy=strategy)
    manager = CheckpointManager(url, "run", keep_last=5, storage_options=options, retry=FAST)
    for step in (1, 2, 3):
        save_shard_files(manager, step, ranks=6)
    Storage(url, options).write_bytes_atomic("run/step_00000004/actor/shard_00000.json", b"{}")  # in flight
    aside = Storage(url, options)  # a timeline set aside: many files that the list does not show
    for rank in range(20):
        aside.write_bytes_atomic(f"run/abandoned/20240101-000000/step_00000009/actor/shard_{rank:05d}.json", b"{}")
    return url, options, fs


@pytest.mark.parametrize("strategy", ["", "put"])
def test_checkpoints_list_reads_the_step_folders_and_manifests_it_prints_and_no_shard(strategy):
    url, options, fs = _run_with_history(strategy)
    requests: list[tuple[str, str]] = []
    fs.on_request = lambda kind, path: requests.append((kind, path.split("/run", 1)[-1]))
    report = inspect_run(CheckpointLocation(url, "run"), deep=False, storage_options=options)
    assert [(r.step, r.committed, r.status, r.latest) for r in report.rows] == [
        (1, True, "ok", False), (2, True, "ok", False), (3, True, "ok", True), (4, False, "uncommitted", False)]
    assert report.resumed == 3 and report.set_aside == 1
    reads = sorted(path for kind, path in requests if kind == "read")
    assert reads == ["/latest", "/step_00000001/MANIFEST.json", "/step_00000002/MANIFEST.json",
                     "/step_00000003/MANIFEST.json"]  # no shard is opened, each manifest once
    listed = [path for kind, path in requests if kind == "list"]
    assert listed.count("") == 1  # the run folder, once
    assert not [path for path in listed if path.startswith("/abandoned/")]  # its timelines are not walked
    assert [path for kind, path in requests if kind == "info"] == [""]  # the run exists; no query per step


def test_checkpoints_verify_hashes_each_step_once_from_the_listing():
    url, options, fs = _run_with_history("put")
    requests: list[tuple[str, str]] = []
    fs.on_request = lambda kind, path: requests.append((kind, path.split("/run", 1)[-1]))
    report = inspect_run(CheckpointLocation(url, "run"), deep=True, storage_options=options)
    assert [r.status for r in report.rows] == ["ok", "ok", "ok", "uncommitted"]
    reads = [path for kind, path in requests if kind == "read"]
    assert len(reads) == len(set(reads)) == 1 + 3 * (1 + 2 * 2 * 6 + 1)  # latest; per step: manifest, files
    assert [info.status for info in list_checkpoints(CheckpointManager(url, "run", storage_options=options))] == [
        "ok", "ok", "ok", "uncommitted"]
