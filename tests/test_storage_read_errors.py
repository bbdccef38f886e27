"""A transient error of a local or NFS checkpoint root (EIO, ESTALE) while the run is listed or a
manifest is looked for is retried, never read as "absent": fsspec's generic ``exists`` reads any
error as False, and its walk leaves out a folder it cannot list, so a committed step looked
uncommitted, and a clean-up deleted it."""

from __future__ import annotations

import errno

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.testing.checkpoint_store import FAST, save_step


def _run(tmp_path) -> CheckpointManager:
    manager = CheckpointManager(str(tmp_path / "ckpt"), "run", keep_last=3, retry=FAST)
    for step in (1, 2, 3):
        save_step(manager, step, world=1)
    return manager


def _fail_once(monkeypatch, fs, method: str, suffix: str) -> list[str]:
    """``fs.method`` raises EIO once for a path ending in ``suffix``; the paths it failed for."""
    real, failed = getattr(fs, method), []

    def flaky(path, *args, **kwargs):
        if str(path).rstrip("/").endswith(suffix) and not failed:
            failed.append(str(path))
            raise OSError(errno.EIO, "Input/output error (injected)", path)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(fs, method, flaky)
    return failed


def test_a_step_folder_that_cannot_be_listed_once_is_not_taken_for_uncommitted(tmp_path, monkeypatch):
    manager = _run(tmp_path)
    failed = _fail_once(monkeypatch, manager.storage.fs, "ls", "run/step_00000003")
    assert manager.cleanup_uncommitted() == [] and failed
    failed.clear()
    assert manager.verify(3, deep=False) == "ok" and failed
    assert manager.committed_steps() == [1, 2, 3] and manager.find_latest_valid() == 3


def test_a_manifest_that_cannot_be_looked_for_once_is_not_taken_for_absent(tmp_path, monkeypatch):
    manager = _run(tmp_path)
    failed = _fail_once(monkeypatch, manager.storage.fs, "info", "step_00000003/MANIFEST.json")
    assert manager.committed_steps() == [1, 2, 3] and failed
    failed.clear()
    assert manager.is_committed(3) and failed


def test_what_is_absent_is_still_absent(tmp_path):
    manager = _run(tmp_path)
    assert not manager.is_committed(4) and manager.storage.find("run/step_00000004") == {}
    assert not manager.storage.exists("run/step_00000003/MANIFEST.json/x")  # a file is no folder
    assert set(manager.storage.find("run/step_00000003")) == {"MANIFEST.json", "trainer_state.json",
                                                             "actor/shard_00000.safetensors", "actor/shard_00000.json"}
