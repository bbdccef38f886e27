"""A write from before a recovery never lands in a recommitted step; a commit checks content
hashes; a checkpoint verified once is not deep-hashed again."""

from __future__ import annotations

import pytest

from resilient_rl.checkpoint import AsyncShardWriter, CheckpointManager, Storage, stage
from resilient_rl.errors import CheckpointCorruptError, StaleWriteError
from resilient_rl.testing.checkpoint_store import FAST, save_step, step_state
from resilient_rl.checkpoint.verify import Verifier


def _manager(tmp_path):
    return CheckpointManager(str(tmp_path), "run", keep_last=5, retry=FAST)


def test_a_stale_writer_cannot_replace_a_shard_of_a_recommitted_step(tmp_path):
    manager = _manager(tmp_path)
    save_step(manager, 4)  # step 4, saved again and committed by the new generation
    shard = tmp_path / "run" / "step_00000004" / "actor" / "shard_00000.safetensors"
    committed = shard.read_bytes()
    # The writer of the abandoned save of step 4 (generation 1), still running, finishes now.
    with AsyncShardWriter(generation=1) as stale:
        staged = stage(step_state(99, 0), 0, world_size=2, rank_local=("rng",))
        future = stale.submit(staged, Storage(str(tmp_path), retry=FAST), "run/step_00000004/actor", 0)
        with pytest.raises(StaleWriteError, match="generation 1"):
            future.result()
    assert shard.read_bytes() == committed
    assert manager.verify(4) == "ok"


def test_a_writer_of_an_uncommitted_step_writes_as_before(tmp_path):
    with AsyncShardWriter(generation=2) as writer:
        staged = stage(step_state(2, 0), 0, world_size=1, rank_local=("rng",))
        records = writer.submit(staged, Storage(str(tmp_path), retry=FAST), "run/step_00000002/actor", 0).result()
    assert [r.path for r in records] == ["shard_00000.safetensors", "shard_00000.json"]


def test_a_commit_refuses_a_shard_whose_content_differs_from_its_record(tmp_path):
    manager = _manager(tmp_path)
    files = save_step(manager, 2, commit=False)
    shard = tmp_path / "run" / "step_00000002" / "actor" / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: the old commit, checking sizes only, committed it
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="shard_00001.safetensors does not hold what its writer"):
        manager.commit(2, files, {"actor": 2})
    assert not manager.is_committed(2)


def test_a_checkpoint_is_deep_hashed_once(tmp_path, monkeypatch):
    writer = _manager(tmp_path)
    save_step(writer, 2)
    hashed = []
    real = Verifier.sha256

    def counting(self, path, size):
        hashed.append(path)
        return real(self, path, size)

    monkeypatch.setattr(Verifier, "sha256", counting)
    reader = _manager(tmp_path)
    assert reader.verify(2) == "ok"
    first = len(hashed)
    assert first > 0
    assert reader.find_latest_valid() == 2 and reader.verify(2) == "ok"
    assert len(hashed) == first  # every later recovery: sizes only
    save_step(writer, 2)  # recommitted: a new manifest is verified again
    assert reader.verify(2) == "ok" and len(hashed) > first
