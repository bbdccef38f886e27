"""What killed writers leave behind is cleaned up at start and after a restore, never a save in flight."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resilient_rl.checkpoint import CheckpointManager, FileRecord, Storage, step_dirname
from resilient_rl.cli import main
from resilient_rl.errors import ConfigError
from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
from resilient_rl.config.schema import load_config
from resilient_rl.testing.checkpoint_store import listings

RUN = "clean"
OTHER_PID = 999_999_999  # a writer that no longer exists


def _commit(manager: CheckpointManager, step: int) -> None:
    manager.begin_step(step)
    manager.write_trainer_state(step, {"step": step})
    rec = manager.storage.write_bytes_atomic(Storage.join(RUN, step_dirname(step), "actor", "shard_00000.json"), b"{}")
    data = manager.storage.write_bytes_atomic(
        Storage.join(RUN, step_dirname(step), "actor", "shard_00000.safetensors"), b"x" * 16)
    manager.commit(step, {"actor": [FileRecord("shard_00000.json", rec.size, rec.sha256),
                                    FileRecord("shard_00000.safetensors", data.size, data.sha256)]}, {"actor": 1})


def _leftovers(manager: CheckpointManager) -> dict[str, str]:
    """Files a killed run leaves: half-written steps and temp files of unfinished atomic writes."""
    s = manager.storage
    paths = {
        "uncommitted": Storage.join(RUN, step_dirname(3), "actor", "shard_00000.safetensors"),
        "in_flight": Storage.join(RUN, step_dirname(4), "actor", "shard_00000.safetensors"),
        "in_flight_tmp": Storage.join(RUN, step_dirname(4), "actor", f"shard_00000.json.tmp-{OTHER_PID}-0123abcd"),
        "committed_tmp": Storage.join(RUN, step_dirname(1), f"MANIFEST.json.tmp-{OTHER_PID}-89abcdef"),
        "latest_tmp": Storage.join(RUN, f"latest.tmp-{OTHER_PID}-00ff00ff"),
        "own_tmp": Storage.join(RUN, f"latest.tmp-{os.getpid()}-11111111"),
    }
    for path in paths.values():
        s.fs.makedirs(s.full_path(path).rsplit("/", 1)[0], exist_ok=True)
        s.fs.pipe_file(s.full_path(path), b"partial")
    return paths


def test_cleanup_removes_leftovers_but_not_the_save_in_flight(tmp_path):
    manager = CheckpointManager(str(tmp_path), RUN)
    _commit(manager, 1)
    paths = _leftovers(manager)
    with listings(manager.storage) as calls:
        assert manager.cleanup_uncommitted(exclude_step=4) == [3]
    assert calls.count(("find", RUN)) == 1  # one walk of the run finds both step folders and temp files
    exists = {k: manager.storage.exists(p) for k, p in paths.items()}
    assert exists == {"uncommitted": False, "in_flight": True, "in_flight_tmp": True, "committed_tmp": False,
                      "latest_tmp": False, "own_tmp": True}
    assert manager.verify(1) == "ok" and manager.latest_step() == 1


def _cfg(tmp_path, *extra: str):
    return load_config(None, [f"checkpoint.root={tmp_path}/ckpt", f"trainer.run_name={RUN}",
                              f"trainer.output_dir={tmp_path}/runs", *extra])


def test_coordinator_cleans_at_start_sparing_pending_and_abandoned_saves(tmp_path):
    coord = CheckpointCoordinator(_cfg(tmp_path))
    _commit(coord.manager, 1)
    paths = _leftovers(coord.manager)
    coord.prepare()  # before the cluster starts: only checks that the root takes writes
    assert coord.manager.storage.exists(paths["uncommitted"])
    coord.acquire_lease()  # the run's start (restore) cleans up once this controller holds the run
    coord.cleanup()  # nothing of this process is in flight yet
    assert not coord.manager.storage.exists(paths["uncommitted"])
    assert not coord.manager.storage.exists(paths["in_flight"])
    _leftovers(coord.manager)
    coord.pending = {"step": 4}
    coord.abandon()  # a failure: step 4's surviving ranks may still be writing
    assert coord.abandoned == 4
    assert coord.cleanup() == [3]
    assert coord.manager.storage.exists(paths["in_flight"])
    coord.release_lease()


def test_a_recovery_lists_the_storage_only_when_a_save_may_have_left_files(tmp_path, monkeypatch):
    """A clean-up reads the run's storage (a listing of every step) at start, and then only after a
    save was abandoned, refused or skipped: a recovery with no save in flight reads nothing."""
    coord = CheckpointCoordinator(_cfg(tmp_path))
    _commit(coord.manager, 1)
    listings = []
    real = coord.manager.cleanup_uncommitted
    monkeypatch.setattr(coord.manager, "cleanup_uncommitted", lambda **kw: listings.append(kw) or real(**kw))
    coord.acquire_lease()
    paths = _leftovers(coord.manager)
    assert coord.cleanup() == [3, 4] and len(listings) == 1  # the start: an earlier controller's leftovers
    coord.abandon()  # nothing in flight
    assert coord.cleanup() == [] and len(listings) == 1
    coord.pending = {"step": 5}
    coord.abandon()
    _leftovers(coord.manager)
    assert coord.cleanup() == [3, 4] and len(listings) == 2
    assert coord.cleanup() == [] and len(listings) == 2
    coord._refuse(6, "actor", "NaN")
    assert coord.cleanup() == [] and len(listings) == 3
    assert not coord.manager.storage.exists(paths["uncommitted"])
    coord.release_lease()


def test_unwritable_checkpoint_root_is_refused_before_the_cluster_starts(tmp_path, capsys):
    import ray

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = _cfg(tmp_path, f"checkpoint.root={blocker}/ckpt")
    with pytest.raises(ConfigError, match=r"checkpoint\.root=.*a-file/ckpt.* cannot be written"):
        CheckpointCoordinator(cfg).prepare()
    CheckpointCoordinator(_cfg(tmp_path, f"checkpoint.root={blocker}/ckpt", "checkpoint.save_every=0")).prepare()
    code = main(["-q", "train", f"checkpoint.root={blocker}/ckpt", f"trainer.output_dir={tmp_path}/runs"])
    assert code == 2 and "checkpoint.root" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_incomplete_multipart_uploads_of_the_run_are_aborted(moto):
    if isinstance(moto, str):
        pytest.skip(moto)
    import s3fs

    fs = s3fs.S3FileSystem(**moto.storage_options)
    keys = {"killed": f"root/{RUN}/{step_dirname(3)}/actor/shard_00000.safetensors",
            "in_flight": f"root/{RUN}/{step_dirname(4)}/actor/shard_00000.safetensors",
            "other_run": f"root/{RUN}_v2/{step_dirname(3)}/actor/shard_00000.safetensors"}
    for key in keys.values():
        fs.call_s3("create_multipart_upload", Bucket="ckpt", Key=key)
    manager = CheckpointManager("s3://ckpt/root", RUN, storage_options=moto.storage_options)
    manager.cleanup_uncommitted(exclude_step=4)
    left = {u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket="ckpt").get("Uploads", [])}
    assert keys["killed"] not in left
    assert {keys["in_flight"], keys["other_run"]} <= left
    for upload in fs.call_s3("list_multipart_uploads", Bucket="ckpt").get("Uploads", []):
        fs.call_s3("abort_multipart_upload", Bucket="ckpt", Key=upload["Key"], UploadId=upload["UploadId"])


def test_faulty_storage_is_not_registered_in_production(tmp_path):
    code = ("import fsspec\n"
            "from resilient_rl.checkpoint.storage import Storage\n"
            "from resilient_rl.errors import StorageError\n"
            "import resilient_rl.trainer.ppo, resilient_rl.cli\n"
            "assert 'faulty' not in fsspec.available_protocols(), 'registered at import'\n"
            "try:\n"
            "    Storage('faulty://" + str(tmp_path) + "', {'target_protocol': 'file'})\n"
            "except StorageError as exc:\n"
            "    assert 'RRL_FAULT_INJECTION' in str(exc), exc\n"
            "else:\n"
            "    raise SystemExit('faulty:// opened without opting in')\n")
    env = {k: v for k, v in os.environ.items() if k != "RRL_FAULT_INJECTION"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    opted_in = "import fsspec; from resilient_rl.checkpoint.storage import Storage; " \
               f"print(type(Storage('faulty://{tmp_path}', {{'target_protocol': 'file'}}).fs).__name__)"
    proc = subprocess.run([sys.executable, "-c", opted_in], env={**env, "RRL_FAULT_INJECTION": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "FaultyFileSystem", proc.stderr[-2000:]
