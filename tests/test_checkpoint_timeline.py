"""Resume means what it says: a run continued from a step keeps that timeline; newer steps of the
abandoned one are set aside (not deleted), and recovery restores from this timeline only."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from resilient_rl.checkpoint import CheckpointManager, Manifest
from resilient_rl.testing.local_group import CheckpointOnlyPool
from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
from resilient_rl.config.schema import load_config
from resilient_rl.errors import NoValidCheckpointError

from resilient_rl.testing.checkpoint_store import FAST, checkpoint_root, save_step

NO_ROLES = CheckpointOnlyPool({})  # controller state only: the source choice is under test


def _rewrite_manifest(manager: CheckpointManager, step: int, **changes) -> None:
    m = manager.load_manifest(step)
    fields = {**m.__dict__, **changes}
    manager.storage.write_bytes_atomic(f"{manager.run_name}/step_{step:08d}/MANIFEST.json",
                                       Manifest(**fields).to_bytes())


def test_latest_step_honours_the_pointer_over_an_abandoned_newer_step(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=5)
    for step in (2, 4, 6):
        save_step(manager, step)
    # Step 6 belongs to a writer superseded by the one that committed step 4 (token 2 > 1).
    _rewrite_manifest(manager, 6, fencing_token=1)
    _rewrite_manifest(manager, 4, fencing_token=2)
    manager.storage.write_bytes_atomic("run/latest", b"step_00000004")
    assert manager.latest_step() == 4 and manager.find_latest_valid() == 4
    assert manager.timeline_steps() == [2, 4] and manager.committed_steps() == [2, 4, 6]
    # Same writer, step 4 re-committed after step 6 (a replay): the commit time decides.
    _rewrite_manifest(manager, 6, fencing_token=2, created_at=time.time() - 100)
    assert manager.latest_step() == 4
    # A crash between step 6's manifest and the pointer: step 6 is newer in every way and is found.
    _rewrite_manifest(manager, 6, fencing_token=2, created_at=time.time() + 100)
    assert manager.latest_step() == 6 and manager.find_latest_valid() == 6


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_set_aside_moves_newer_steps_out_of_the_run(kind, tmp_path, moto):
    root, options = checkpoint_root(kind, tmp_path, moto)
    manager = CheckpointManager(root, "run", keep_last=5, storage_options=options, retry=FAST)
    for step in (2, 4, 6, 8):
        save_step(manager, step)
    assert manager.set_aside_newer(4, "resumed from step 4") == [6, 8]
    assert manager.committed_steps() == [2, 4] and manager.latest_step() == 4
    assert manager.storage.read_bytes("run/latest") == b"step_00000004"
    [stamp] = manager.storage.ls("run/abandoned")
    aside = CheckpointManager(f"{root}/run/abandoned", stamp, storage_options=options, retry=FAST)
    assert aside.committed_steps() == [6, 8] and aside.verify(8) == "ok"  # intact, loadable by hand
    note = json.loads(manager.storage.read_bytes(f"run/abandoned/{stamp}/SET_ASIDE.json"))
    assert note["steps"] == [6, 8] and note["reason"] == "resumed from step 4"
    assert manager.set_aside_newer(4, "again") == []


def _cfg(root: str, run: str, resume: str = "auto"):
    return load_config(None, [f"checkpoint.root={root}", f"trainer.run_name={run}", f"checkpoint.resume={resume}",
                              "checkpoint.keep_last=5"])


def _coordinator(root: str, run: str, resume: str = "auto") -> CheckpointCoordinator:
    ckpt = CheckpointCoordinator(_cfg(root, run, resume))
    ckpt.manager.retry = FAST
    return ckpt


def test_resume_from_an_earlier_step_keeps_that_timeline_through_recovery():
    root = f"memory://timeline-{uuid.uuid4().hex}"
    first = _coordinator(root, "run")
    for step in (2, 4, 6, 8):
        save_step(first.manager, step)
    ckpt = _coordinator(root, "run", f"path:{root}/run/step_00000004")
    ckpt.acquire_lease()
    try:
        assert ckpt.restore(NO_ROLES, ckpt.cfg.checkpoint.resume)["step"] == 4
        assert ckpt.manager.committed_steps() == [2, 4] and ckpt.manager.latest_step() == 4
        # A failure before the next commit: recovery restores step 4 again, never 8 nor step 0.
        assert ckpt.restore(NO_ROLES, "auto")["step"] == 4
        save_step(ckpt.manager, 6)
        assert ckpt.restore(NO_ROLES, "auto")["step"] == 6
        assert ckpt.manager.load_manifest(6).fencing_token == ckpt.lease.token
        [stamp] = ckpt.manager.storage.ls("run/abandoned")
        assert sorted(ckpt.manager.storage.ls(f"run/abandoned/{stamp}")) == [
            "SET_ASIDE.json", "step_00000006", "step_00000008"]
    finally:
        ckpt.release_lease()


def test_resume_from_another_run_recovers_to_that_checkpoint_until_it_commits():
    root = f"memory://timeline-{uuid.uuid4().hex}"
    src = _coordinator(root, "src")
    for step in (2, 4):
        save_step(src.manager, step)
    dst_old = _coordinator(root, "dst")
    save_step(dst_old.manager, 6)  # an earlier, unrelated attempt under the same run name
    ckpt = _coordinator(root, "dst", f"path:{root}/src/step_00000002")
    assert ckpt.restore(NO_ROLES, ckpt.cfg.checkpoint.resume)["step"] == 2
    assert ckpt.manager.committed_steps() == [] and ckpt.manager.latest_step() is None
    state = ckpt.restore(NO_ROLES, "auto")  # recovery before dst committed anything
    assert state is not None and state["step"] == 2
    save_step(ckpt.manager, 4)
    assert ckpt.restore(NO_ROLES, "auto")["step"] == 4
    assert src.manager.committed_steps() == [2, 4]  # the source run is never touched


@pytest.mark.parametrize("spelling", ["symlink", "dotdot"])
def test_a_path_to_the_runs_own_step_by_another_spelling_is_the_same_run(spelling, tmp_path):
    """Naming the run's own step through a symlink or a ``..`` keeps the run's timeline up to that
    step: before, the run was taken for another one and every committed step, the one just loaded
    included, was set aside, so a later recovery had nothing to go back to."""
    root = tmp_path / "ckpt"
    first = _coordinator(str(root), "run")
    for step in (2, 4, 6):
        save_step(first.manager, step)
    if spelling == "symlink":
        (tmp_path / "link").symlink_to(root)
        step_dir = tmp_path / "link" / "run" / "step_00000004"
    else:
        (tmp_path / "other").mkdir()
        step_dir = f"{tmp_path}/other/../ckpt/run/step_00000004"
    ckpt = _coordinator(str(root), "run", f"path:{step_dir}")
    assert ckpt.restore(NO_ROLES, ckpt.cfg.checkpoint.resume)["step"] == 4
    assert ckpt.manager.committed_steps() == [2, 4]  # only the newer step 6 was set aside
    assert ckpt.restore(NO_ROLES, "auto")["step"] == 4  # a recovery before the next commit


def test_a_storage_location_is_the_same_whatever_the_protocols_spelling():
    from resilient_rl.checkpoint.storage import Storage

    assert Storage("s3a://bucket/ckpt").location("run") == Storage("s3://bucket/ckpt/").location("run")
    assert Storage("s3://bucket/ckpt").location("run") != Storage("s3://bucket/ckpt2").location("run")


def test_a_resumed_run_whose_base_is_gone_stops_instead_of_starting_over():
    """The other run's retention deleted the step this run was resumed from, and this run committed
    nothing since: a recovery stops with an error naming the step, instead of going back to step 0
    and throwing away the resumed progress."""
    root = f"memory://timeline-{uuid.uuid4().hex}"
    src = _coordinator(root, "src")
    for step in (2, 4):
        save_step(src.manager, step)
    ckpt = _coordinator(root, "dst", f"path:{root}/src/step_00000002")
    assert ckpt.restore(NO_ROLES, ckpt.cfg.checkpoint.resume)["step"] == 2
    src.manager.storage.rm("src/step_00000002", recursive=True)
    with pytest.raises(NoValidCheckpointError, match=r"src/step_00000002, is now uncommitted.*checkpoint.resume=off"):
        ckpt.restore(NO_ROLES, "auto")
    assert src.manager.committed_steps() == [4]


def test_a_rollback_after_a_nan_stays_on_the_runs_timeline(tmp_path):
    """Step 6 belongs to a superseded writer (the pointer names step 4, committed with a higher
    token): a rollback to the newest known-good step takes step 4, not step 6."""
    ckpt = _coordinator(str(tmp_path), "run")
    for step in (2, 4, 6):
        save_step(ckpt.manager, step)
        _rewrite_manifest(ckpt.manager, step, known_good=True)
    _rewrite_manifest(ckpt.manager, 6, fencing_token=1, known_good=True)
    _rewrite_manifest(ckpt.manager, 4, fencing_token=2, known_good=True)
    ckpt.manager.storage.write_bytes_atomic("run/latest", b"step_00000004")
    assert ckpt.restore(NO_ROLES, "known_good")["step"] == 4


def test_resume_off_sets_the_runs_old_steps_aside():
    root = f"memory://timeline-{uuid.uuid4().hex}"
    old = _coordinator(root, "run")
    for step in (2, 4):
        save_step(old.manager, step)
    fresh = _coordinator(root, "run")  # restore("off"): what checkpoint.resume=off starts with
    assert fresh.restore(NO_ROLES, "off") is None
    assert fresh.manager.committed_steps() == [] and not fresh.manager.storage.exists("run/latest")
    assert fresh.restore(NO_ROLES, "auto") is None  # a recovery starts over from step 0, not old step 4


@pytest.mark.parametrize("url, root, run, step", [("/my-run/step_00000003", "/", "my-run", 3),
                                                 ("ckpt/my-run/step_7", "ckpt", "my-run", 7),
                                                 ("s3://bucket/my-run/step_00000020", "s3://bucket", "my-run", 20)])
def test_a_resume_path_splits_into_root_run_and_step(url, root, run, step):
    from resilient_rl.checkpoint.restore import split_step_url

    assert split_step_url(url) == (root, run, step)


@pytest.mark.parametrize("url, says", [("my-run/step_3", "expected a step folder"),
                                       ("s3://bucket/step_3", "names no folder above the run's"),
                                       ("/my-run/latest", "expected a step folder")])
def test_a_resume_path_without_a_root_run_and_step_is_a_config_error_naming_it(url, says):
    from resilient_rl.checkpoint.restore import split_step_url
    from resilient_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=f"checkpoint.resume=path:{url}: {says}"):
        split_step_url(url)


def test_resuming_from_a_path_where_nothing_is_stored_says_so(tmp_path):
    from resilient_rl.checkpoint.restore import Restorer
    from resilient_rl.errors import CheckpointNotFoundError

    manager = CheckpointManager(str(tmp_path), "run")
    restorer = Restorer(manager, None, on_event=lambda *a, **k: None, on_corrupt=lambda *a: None)
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        restorer._source(f"path:{tmp_path}/other/step_00000004")
    (tmp_path / "other" / "step_00000004" / "actor").mkdir(parents=True)
    (tmp_path / "other" / "step_00000004" / "actor" / "shard_00000.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="is uncommitted .it has no MANIFEST.json"):
        restorer._source(f"path:{tmp_path}/other/step_00000004")
