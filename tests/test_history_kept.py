"""History is never cut: no valid checkpoint stops a restore instead of starting over, a fresh
start in a used run folder sets the earlier history aside, a newer-format checkpoint stops the run."""

from __future__ import annotations

import json

import pytest

from resilient_rl.checkpoint import MANIFEST_NAME
from resilient_rl.config.schema import load_config
from resilient_rl.errors import CheckpointFormatError, NoValidCheckpointError, RecoveryError, WorkerDiedError
from resilient_rl.testing.checkpoint_roles import LocalCheckpointRoles
from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
from resilient_rl.run.folder import RunDir
from resilient_rl.checkpoint.inspect import list_checkpoints

RUN = "hist"


def _coordinator(tmp_path):
    cfg = load_config(None, [f"trainer.run_name={RUN}", f"trainer.output_dir={tmp_path}/runs",
                             f"checkpoint.root={tmp_path}/ckpt", "trainer.total_steps=100", "checkpoint.save_every=2",
                             "checkpoint.async_save=false", "checkpoint.keep_last=5"])
    events: list[tuple[str, dict]] = []
    return CheckpointCoordinator(cfg, on_event=lambda kind, **f: events.append((kind, f))), events


def _committed(coord, roles, *steps):
    for step in steps:
        roles.train_step(step)
        coord.save(roles, step, {"step": step}, "digest")
        coord.wait(roles)
    assert coord.manager.committed_steps() == list(steps)


def _damage(coord, step):
    path = coord.manager.storage.full_path(f"{RUN}/step_{step:08d}/trainer_state.json")
    with open(path, "ab") as f:
        f.write(b" ")


def test_no_valid_checkpoint_stops_the_restore_and_sets_nothing_aside(tmp_path):
    coord, events = _coordinator(tmp_path)
    with LocalCheckpointRoles() as roles:
        _committed(coord, roles, 2, 4)
        _damage(coord, 2)
        _damage(coord, 4)
        with pytest.raises(NoValidCheckpointError, match="checkpoint.resume=off"):
            coord.restore(roles, "auto")
        assert coord.manager.committed_steps() == [2, 4]  # the old code moved both to abandoned/
        assert not any(k == "checkpoints_set_aside" for k, _ in events)
        assert coord.restore(roles, "off") is None  # starting over is the operator's explicit choice
        assert coord.manager.committed_steps() == []


def test_a_newer_format_checkpoint_stops_with_the_version_and_the_upgrade(tmp_path):
    coord, events = _coordinator(tmp_path)
    with LocalCheckpointRoles() as roles:
        _committed(coord, roles, 2, 4)
        path = coord.manager.storage.full_path(f"{RUN}/step_00000004/{MANIFEST_NAME}")
        manifest = json.loads(open(path).read())
        with open(path, "w") as f:
            json.dump({**manifest, "format_version": 7}, f)
        with pytest.raises(CheckpointFormatError, match="format_version 7.*pip install -U resilient-rl"):
            coord.restore(roles, "auto")
        assert coord.manager.committed_steps() == [2, 4]  # not skipped to step 2, nothing set aside
        assert not any(k in ("checkpoint_corrupt", "checkpoints_set_aside") for k, _ in events)
        rows = {i.step: i.status for i in list_checkpoints(coord.manager)}
        assert rows[2] == "ok" and rows[4].startswith("newer format")


def test_a_fresh_start_in_a_used_run_folder_keeps_the_earlier_history(tmp_path):
    run_dir = RunDir(str(tmp_path), "used")
    for step in (1, 2, 3, 4):
        run_dir.append_metrics({"step": step, "reward/mean": step / 10})
    moved = run_dir.set_aside_history()
    assert moved is not None and moved.parent.name == "abandoned"
    run_dir.append_metrics({"step": 1, "reward/mean": 0.9})
    run_dir.append_metrics({"step": 2, "reward/mean": 0.8})
    run_dir.truncate_metrics_after(1)  # a rollback of the new run cuts only its own rows
    assert [r["step"] for r in run_dir.read_metrics()] == [1]
    assert [json.loads(line)["step"] for line in moved.read_text().splitlines()] == [1, 2, 3, 4]


def test_the_trainer_sets_an_earlier_history_aside_at_a_fresh_start(tmp_path):
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, ["trainer.total_steps=1", "trainer.progress_bar=false", "data.batch_size=8",
                             "data.num_prompts=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                             "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                             "telemetry.enabled=false", f"trainer.output_dir={tmp_path}/runs", "trainer.run_name=r"])
    old = RunDir(f"{tmp_path}/runs", "r")
    for step in (1, 2, 3):
        old.append_metrics({"step": step, "reward/mean": 0.0})
    trainer = PPOTrainer(cfg, roles_factory=LocalRoles)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert [r["step"] for r in trainer.run_dir.read_metrics()] == [1]
    kept = list((trainer.run_dir.path / "abandoned").glob("metrics-*.jsonl"))
    assert len(kept) == 1 and len(kept[0].read_text().splitlines()) == 3


def test_a_recovery_without_a_valid_checkpoint_gives_up_and_keeps_the_history(tmp_path):
    """Before: the recovery restarted at step 0, truncated metrics.jsonl to nothing and set every
    committed step aside."""
    from collections import deque

    from resilient_rl.checkpoint.controller_state import Attribute, ControllerState
    from resilient_rl.recovery.attempt import Attempt
    from resilient_rl.recovery.causes import classify
    from resilient_rl.recovery.driver import Restoring
    from resilient_rl.recovery.rollback import RollBack

    coord, _ = _coordinator(tmp_path)
    run_dir = RunDir(f"{tmp_path}/runs", RUN)
    for step in (1, 2, 3, 4, 5):
        run_dir.append_metrics({"step": step})
    with LocalCheckpointRoles() as roles:
        _committed(coord, roles, 2, 4)
        _damage(coord, 2)
        _damage(coord, 4)
        counter = type("Counter", (), {"step": 5})()
        state = ControllerState()
        state.register("step", Attribute(counter, "step", int))
        rollback = RollBack(coord, None, state, run_dir, deque(maxlen=10), digest="d")
        died = WorkerDiedError("actor rank 0 died", role="actor", rank=0)
        with pytest.raises(RecoveryError, match="none of the committed checkpoints"):
            Restoring(rollback).enter(Attempt(6, classify(died), died), roles)
    assert [r["step"] for r in run_dir.read_metrics()] == [1, 2, 3, 4, 5]
    assert coord.manager.committed_steps() == [2, 4]


def test_a_roll_back_reads_the_metric_history_only_when_rows_past_the_point_exist(tmp_path, monkeypatch):
    """Rows after the point are cut from the file and the in-memory history; a roll-back to the
    newest recorded step (a recovery from the snapshot of the step before the failure) leaves the
    file unread, however long it is."""
    from collections import deque

    from resilient_rl.checkpoint.controller_state import Attribute, ControllerState
    from resilient_rl.recovery.rollback import RollBack, checkpoint

    coord, _ = _coordinator(tmp_path)
    run_dir = RunDir(f"{tmp_path}/runs", RUN)
    reads = []
    for name in ("truncate_metrics_after", "read_metrics"):
        real = getattr(run_dir, name)
        monkeypatch.setattr(run_dir, name,
                            lambda *a, _real=real, _name=name, **k: reads.append(_name) or _real(*a, **k))
    history = deque(maxlen=3)
    with LocalCheckpointRoles() as roles:
        _committed(coord, roles, 2, 4)
        roles.sync_weights = lambda version: {}  # no rollout among these roles
        counter = type("Counter", (), {"step": 0})()
        state = ControllerState()
        state.register("step", Attribute(counter, "step", int))
        rollback = RollBack(coord, None, state, run_dir, history, digest="d")
        for step in (1, 2, 3, 4):
            run_dir.append_metrics({"step": step})
            history.append({"step": step})
        assert rollback.roll_back_to(roles, checkpoint("auto")) == 4
        assert reads == [] and [r["step"] for r in history] == [2, 3, 4]
        for step in (5, 6):
            run_dir.append_metrics({"step": step})
            history.append({"step": step})
        assert rollback.roll_back_to(roles, checkpoint("auto")) == 4
        assert reads == ["truncate_metrics_after", "read_metrics"]
        assert [r["step"] for r in history] == [2, 3, 4]
        history.clear()  # a new controller: the file is read
        assert rollback.roll_back_to(roles, checkpoint("auto")) == 4
        assert [r["step"] for r in history] == [2, 3, 4] and len(reads) == 4
    assert [r["step"] for r in run_dir.read_metrics()] == [1, 2, 3, 4]
