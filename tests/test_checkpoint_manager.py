"""The commit protocol: manifest + latest, discovery and verification, fallback from corrupt
checkpoints, cleanup of uncommitted steps, retention, and behaviour under storage faults."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from resilient_rl.checkpoint import CheckpointManager, Storage
from resilient_rl.checkpoint.manifest import FORMAT_VERSION
from resilient_rl.errors import (
    CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError, StorageError,
)
from resilient_rl.faults.storage import FaultPlan, faulty_url
from resilient_rl.testing.checkpoint_store import FAST, checkpoint_root, load_step, save_step
from resilient_rl.checkpoint.inspect import list_checkpoints


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_commit_writes_manifest_then_latest(kind, tmp_path, moto):
    root, options = checkpoint_root(kind, tmp_path, moto)
    manager = CheckpointManager(root, "run", storage_options=options, retry=FAST)
    assert manager.latest_step() is None and manager.find_latest_valid() is None
    save_step(manager, 5)
    storage = manager.storage
    assert storage.read_bytes("run/latest") == b"step_00000005"
    manifest = json.loads(storage.read_bytes("run/step_00000005/MANIFEST.json"))
    assert manifest["format_version"] == FORMAT_VERSION and manifest["step"] == 5
    assert manifest["world_sizes"] == {"actor": 2} and manifest["config_digest"] == "cfg-1"
    assert [f["path"] for f in manifest["files"]] == [
        "actor/shard_00000.json", "actor/shard_00000.safetensors", "actor/shard_00001.json",
        "actor/shard_00001.safetensors", "trainer_state.json"]
    assert all(f["size"] == size for f, size in zip(
        manifest["files"], [storage.size(f"run/step_00000005/{f['path']}") for f in manifest["files"]]))
    assert manager.latest_step() == 5 and manager.verify(5) == "ok"
    assert manager.load_trainer_state(5) == {"step": 5, "data": {"epoch": 0, "index": 15}}
    loaded = load_step(manager, 5, rank=1)
    assert torch.equal(loaded["w"], torch.arange(6.0) * 5) and loaded["rng"]["seed"] == 5001
    assert torch.equal(loaded["rng"]["state"], torch.ones(64, dtype=torch.uint8))
    [info] = list_checkpoints(manager)
    assert (info.step, info.committed, info.status) == (5, True, "ok")
    assert info.size_bytes == sum(f["size"] for f in manifest["files"]) + len(json.dumps(manifest, indent=1))
    assert 0 <= info.age_s < 600


def test_commit_refuses_missing_or_mismatched_shards(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run")
    files = save_step(manager, 1, commit=False)
    with pytest.raises(CheckpointError, match="rank 2 reported no shard_00002"):
        manager.commit(1, files, {"actor": 3})
    (tmp_path / "run" / "step_00000001" / "actor" / "shard_00001.safetensors").write_bytes(b"short")
    with pytest.raises(CheckpointError, match=r"shard_00001\.safetensors is 5 bytes"):
        manager.commit(1, files, {"actor": 2})
    with pytest.raises(CheckpointError, match="roles"):
        manager.commit(1, files, {"critic": 2})
    assert not manager.is_committed(1) and manager.latest_step() is None


def test_uncommitted_step_is_never_returned_and_is_cleaned_up(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run")
    save_step(manager, 1)
    save_step(manager, 2, commit=False)  # the process died before the commit
    save_step(manager, 3, commit=False)  # being written right now
    assert manager.latest_step() == 1 and manager.find_latest_valid() == 1
    assert manager.verify(2) == "uncommitted"
    with pytest.raises(CheckpointNotFoundError, match="step 2 is not committed"):
        manager.load_manifest(2)
    assert [(i.step, i.committed, i.status) for i in list_checkpoints(manager)] == [
        (1, True, "ok"), (2, False, "uncommitted"), (3, False, "uncommitted")]
    assert manager.cleanup_uncommitted(exclude_step=3) == [2]
    assert not (tmp_path / "run" / "step_00000002").exists()
    assert (tmp_path / "run" / "step_00000003").exists()


def test_flipped_byte_makes_step_corrupt_and_previous_is_used(tmp_path):
    reports = []
    manager = CheckpointManager(str(tmp_path), "run", keep_last=3, on_corrupt=lambda s, r: reports.append((s, r)))
    save_step(manager, 1)
    save_step(manager, 2)
    shard = tmp_path / "run" / "step_00000002" / "actor" / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x10  # in rank 1's own (rank-local) tensor data
    shard.write_bytes(bytes(data))
    assert manager.verify(2, deep=False) == "ok"  # same size: only the checksum can tell
    assert manager.verify(2) == "corrupt: actor/shard_00001.safetensors: sha256 mismatch"
    assert manager.find_latest_valid() == 1
    assert reports == [(2, "corrupt: actor/shard_00001.safetensors: sha256 mismatch")]
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/actor.*shard_00001\.safetensors"):
        load_step(manager, 2, rank=1)
    assert torch.equal(load_step(manager, 1)["w"], torch.arange(6.0))


def test_missing_truncated_and_garbled_files_are_reported(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=5)
    for step in (1, 2, 3, 4):
        save_step(manager, step)
    step_dir = tmp_path / "run"
    (step_dir / "step_00000004" / "actor" / "shard_00000.json").unlink()
    (step_dir / "step_00000003" / "trainer_state.json").write_text("{}")
    (step_dir / "step_00000002" / "MANIFEST.json").write_text("{not json")
    assert manager.verify(4, deep=False) == "corrupt: actor/shard_00000.json: missing"
    assert manager.verify(3, deep=False).startswith("corrupt: trainer_state.json: size 2 != ")
    assert manager.verify(2).startswith("corrupt: MANIFEST.json:")
    seen = []
    manager.on_corrupt = lambda s, r: seen.append(s)
    assert manager.find_latest_valid(deep=False) == 1 and seen == [4, 3, 2]
    with pytest.raises(CheckpointCorruptError, match="trainer_state.json"):
        manager.load_trainer_state(3)


def test_retention_keeps_last_k_and_every_mth(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=2, keep_every=3)
    for step in range(1, 8):
        save_step(manager, step)
    assert manager.committed_steps() == [3, 6, 7]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "latest", "step_00000003", "step_00000006", "step_00000007"]
    assert all(manager.verify(s) == "ok" for s in (3, 6, 7))


def test_old_checkpoint_deleted_only_after_a_newer_commit(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=1)
    save_step(manager, 1)
    save_step(manager, 2, commit=False)
    assert manager.apply_retention() == [] and manager.committed_steps() == [1]
    files = save_step(manager, 2, commit=False)
    manager.commit(2, files, {"actor": 2})
    assert manager.committed_steps() == [2]
    assert manager.storage.read_bytes("run/latest") == b"step_00000002"


def test_resaving_after_restore_to_an_earlier_step(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=3)
    for step in (1, 2, 3):
        save_step(manager, step)
    # Steps 2 and 3 turned out corrupt; the run restored step 1 and replays.
    manager.begin_step(2)
    assert not (tmp_path / "run" / "step_00000002").exists()
    assert manager.storage.read_bytes("run/latest") == b"step_00000003"
    save_step(manager, 2)
    assert manager.committed_steps() == [1, 2]  # step 3 belonged to the abandoned timeline
    assert manager.latest_step() == 2 and manager.storage.read_bytes("run/latest") == b"step_00000002"


def test_manifest_newer_than_latest_pointer_is_found(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=3)
    save_step(manager, 1)
    save_step(manager, 2)
    (tmp_path / "run" / "latest").write_text("step_00000001")  # died between manifest and pointer
    assert manager.latest_step() == 2 and manager.find_latest_valid() == 2


def test_transient_faults_are_retried_and_the_checkpoint_is_byte_correct(tmp_path):
    clean = CheckpointManager(str(tmp_path / "clean"), "run")
    expected = save_step(clean, 1)
    url, options = faulty_url(str(tmp_path / "faulty"), FaultPlan(transient_writes=3, transient_reads=2),
                              name=uuid.uuid4().hex)
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    worker_storage = Storage(url, options, FAST)
    assert worker_storage.fs is manager.storage.fs  # one fault budget for the process
    files = save_step(manager, 1, storage=worker_storage)
    assert files == expected  # same bytes, same checksums
    assert sum(e.startswith("transient write") for e in manager.storage.fs.injected) == 3
    assert manager.find_latest_valid() == 1
    # The read faults met the first reads of any kind: the commit's listing of the step (retried).
    reads = ("transient read", "transient list", "transient info")
    assert sum(e.startswith(reads) for e in manager.storage.fs.injected) == 2
    assert torch.equal(load_step(manager, 1)["w"], torch.arange(6.0))
    for path in (tmp_path / "clean").rglob("*.safetensors"):
        twin = tmp_path / "faulty" / path.relative_to(tmp_path / "clean")
        assert twin.read_bytes() == path.read_bytes()


def test_enospc_keeps_previous_checkpoint_and_latest(tmp_path):
    url, options = faulty_url(str(tmp_path), FaultPlan(), name=uuid.uuid4().hex)
    manager = CheckpointManager(url, "run", storage_options=options, retry=FAST)
    save_step(manager, 1)
    fs = manager.storage.fs
    fs.plan.enospc_after_bytes = fs.bytes_written + 200  # the disk fills up during step 2
    with pytest.raises(StorageError, match=r"step_00000002/actor/shard_0000\d\.\w+.*No space left"):
        save_step(manager, 2)
    assert (tmp_path / "run" / "latest").read_text() == "step_00000001"
    assert manager.latest_step() == 1 and manager.verify(1) == "ok" and manager.find_latest_valid() == 1
    assert not manager.is_committed(2)
    assert manager.cleanup_uncommitted() == [2]
    assert torch.equal(load_step(manager, 1)["w"], torch.arange(6.0))


def test_invalid_configuration_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointManager(str(tmp_path), "run", keep_last=0)
    with pytest.raises(ConfigError, match="run_name"):
        CheckpointManager(str(tmp_path), "a/b")
    with pytest.raises(ConfigError, match="role"):
        CheckpointManager(str(tmp_path), "run").role_dir(1, "../x")
    with pytest.raises(CheckpointError, match="JSON"):
        CheckpointManager(str(tmp_path), "run").write_trainer_state(1, {"x": object()})
