"""``resilient-rl status``: run folders written the way the trainer writes them (RunDir, real
checkpoints, a real controller record), read back by the status reader and the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from resilient_rl.cli import main
from resilient_rl.errors import RecoveryError
from resilient_rl.run_status import gather_status
from resilient_rl.run.info import failure_episodes, open_run
from resilient_rl.telemetry import FileSDWriter
from resilient_rl.testing.run_folder import FakeRun, play_two_failures
from resilient_rl.run.record import (ControllerRecord, controller_alive, controller_session,
                                                    read_controller_record)
from resilient_rl.trainer.hooks import TrainerHook


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["-q", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _finished_run(tmp_path) -> FakeRun:
    """12 steps, checkpoints every 3; actor rank 1 dies at step 8 (restores 6, replays 7), a hung
    critic at step 11 (restores 9, replays 10)."""
    run = FakeRun(tmp_path, total_steps=12, save_every=3)
    with controller_session(run.path, lambda: run.step) as record:
        record.start_step = 0
        record.write(run.path)
        play_two_failures(run)
    return run


def test_finished_run_reports_steps_checkpoint_failures_and_goodput(tmp_path, capsys):
    run = _finished_run(tmp_path)
    code, out, err = _cli(capsys, "status", "demo", "--output-dir", str(tmp_path / "runs"), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["run"] == "demo" and s["state"] == "finished" and s["detail"] is None
    assert s["step"] == 12 and s["total_steps"] == 12
    assert s["controller"]["pid"] == os.getpid() and s["controller"]["ended_at"] is not None
    assert s["checkpoint"]["step"] == 12 and s["checkpoint"]["check"] == "ok"
    assert s["checkpoint"]["committed"] == 4 and s["checkpoint"]["url"].endswith("demo/step_00000012")
    assert [(f["step"], f["cause"], f["role"], f["rank"], f["restored_step"], f["steps_replayed"])
            for f in s["failures"]] == [(8, "died", "main:actor", 1, 6, 1), (11, "timeout", "main:critic", 0, 9, 1)]
    assert s["failures"][1]["killed_unresponsive"] == ["main rank 0"]
    assert [f["restarted"] for f in s["failures"]] == [["main rank 1"], ["main rank 0"]]
    assert s["recoveries"] == 2 and s["steps_replayed"] == 2 and s["recovery_s"] == pytest.approx(13.0)
    # Goodput as telemetry defines it: kept steps' durations over fit's wall time.
    record = read_controller_record(run.path)
    assert s["useful_s"] == pytest.approx(12 * 0.5)
    assert s["wall_s"] == pytest.approx(record.ended_at - record.started_at)
    assert s["goodput"] == pytest.approx(min(1.0, s["useful_s"] / s["wall_s"]))
    assert s["metrics"]["urls"] == [] and "not running" in s["metrics"]["note"]

    code, out, _ = _cli(capsys, "status", str(run.path))
    assert code == 0
    assert "state:       finished" in out and "12 / 12" in out
    assert "step 12, committed" in out and "4 committed" in out
    assert "failures:    2, 2 recovered" in out
    assert "died       main:actor rank 1" in out and "recovered in 4.0 s from step 6" in out
    assert "replayed 1; restarted main rank 1\n" in out
    assert "restarted main rank 0; killed unresponsive main rank 0" in out
    assert "goodput:" in out and "not served" in out


def test_running_run_names_its_live_controller_and_metrics_endpoint(tmp_path):
    run = FakeRun(tmp_path, total_steps=20)
    writer = FileSDWriter(run.path / "prometheus_targets.json")
    with controller_session(run.path, lambda: run.step) as record:
        record.start_step = 0
        record.write(run.path)
        writer.update([("127.0.0.1:9400", {"job": "resilient-rl", "run": "demo", "node": "n0"})])
        run.train(4)
        s = gather_status(str(run.path))
        assert s.state == "running" and s.controller.alive is True and s.controller.host == socket.gethostname()
        assert s.step == 4 and s.checkpoint.step == 3 and s.failures == []
        assert s.metrics.urls == ["http://127.0.0.1:9400/metrics"] and s.metrics.nodes == ["n0"]
        assert s.steps_per_min is not None and s.steps_per_min > 0 and s.recent_step_s == pytest.approx(0.5)
        assert s.goodput is not None and 0 < s.goodput <= 1
        text = s.format_text()
        assert "state:       running; controller pid" in text and "alive" in text
        assert "http://127.0.0.1:9400/metrics (n0)" in text
        writer.close()


def test_controller_that_died_without_a_clean_exit_is_stopped(tmp_path):
    run = FakeRun(tmp_path)
    run.train(5)
    # The record of a real process that then exits without marking its end.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    rec = ControllerRecord(pid=child.pid, host=socket.gethostname(),
                           process_started_at=psutil.Process(child.pid).create_time(), started_at=time.time(),
                           start_step=0)
    rec.write(run.path)
    child.communicate(b"")
    FileSDWriter(run.path / "prometheus_targets.json").update([("127.0.0.1:9400", {"node": "n0"})])
    s = gather_status("demo", output_dir=str(tmp_path / "runs"))
    assert s.state == "stopped" and s.controller.alive is False
    assert "controller not running" in s.detail
    assert s.metrics.note.startswith("stale")
    assert "state:       stopped (controller not running" in s.format_text()


def test_controller_on_another_host_cannot_be_checked(tmp_path):
    run = FakeRun(tmp_path)
    run.train(2)
    rec = ControllerRecord.for_this_process()
    rec.host, rec.start_step = "elsewhere-" + socket.gethostname(), 0
    rec.write(run.path)
    s = gather_status(str(run.path))
    assert s.state == "running?" and s.controller.alive is None
    assert "cannot check from this host" in s.format_text()


def test_failed_and_interrupted_fits_record_how_they_ended(tmp_path):
    run = FakeRun(tmp_path)
    with pytest.raises(RecoveryError):
        with controller_session(run.path, lambda: run.step):
            run.train(2)
            run.abort("critic", 0)
            raise RecoveryError("giving up: critic rank 0 exceeded max_restarts=0")
    s = gather_status(str(run.path))
    assert s.state == "failed" and "giving up" in s.detail
    assert [f.outcome for f in s.failures] == ["aborted"] and "max_restarts" in s.failures[0].abort_reason
    assert "ABORTED" in s.format_text()
    with pytest.raises(KeyboardInterrupt):
        with controller_session(run.path, lambda: run.step):
            raise KeyboardInterrupt
    s = gather_status(str(run.path))
    assert s.state == "interrupted" and s.detail == "at step 2"
    from resilient_rl.errors import Preempted

    with pytest.raises(Preempted):
        with controller_session(run.path, lambda: run.step):
            raise Preempted("preempted by SIGTERM after step 2: step 2 is committed", signal_name="SIGTERM",
                            step=2, committed=2)
    s = gather_status(str(run.path))
    assert s.state == "preempted" and "SIGTERM after step 2" in s.detail and "preempted" in s.format_text()


def test_run_without_a_controller_record_and_a_torn_last_line(tmp_path):
    run = FakeRun(tmp_path)
    run.train(3)
    with open(run.run_dir.metrics_path, "a") as f:
        f.write('{"step": 4, "reward/me')  # an append in progress
    s = gather_status(str(run.path))
    assert s.state == "unknown" and s.controller is None and s.goodput is None
    assert s.step == 3 and s.checkpoint.step == 3
    assert "goodput:     unknown" in s.format_text()


def test_no_checkpoint_yet(tmp_path):
    run = FakeRun(tmp_path, save_every=100)
    run.run_dir.append_metrics(run.row(1))
    s = gather_status(str(run.path))
    assert s.checkpoint.step is None and s.checkpoint.error is None
    assert "none committed yet" in s.format_text()


def test_missing_or_non_run_folder_is_an_error_naming_the_path(tmp_path, capsys):
    code, _, err = _cli(capsys, "status", "nope", "--output-dir", str(tmp_path))
    assert code == 2 and f"no run folder at {tmp_path / 'nope'}" in err
    code, _, err = _cli(capsys, "status", str(tmp_path / "missing"))
    assert code == 2 and str(tmp_path / "missing") in err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    code, _, err = _cli(capsys, "status", str(tmp_path / "other"))
    assert code == 2 and f"{tmp_path / 'other'} is not a run folder" in err


def test_failure_episodes_shorten_group_names_and_keep_pending_ones(tmp_path):
    run = FakeRun(tmp_path, name="x-run")
    run.train(1)
    run.run_dir.event("failure", step=2, role=f"{run.group}:actor", rank=0, cause="collective",
                      message=f"{run.group}:actor rank 0: gloo broke")
    episodes = failure_episodes(open_run(str(run.path)).events, "x-run")
    assert [(e.role, e.outcome, e.message) for e in episodes] == [
        ("main:actor", "pending", "main:actor rank 0: gloo broke")]



def test_status_names_the_state_a_pending_recovery_last_entered(tmp_path, capsys):
    run = FakeRun(tmp_path, name="x-run")
    run.train(1)
    run.run_dir.event("failure", step=2, role=f"{run.group}:actor", rank=0, cause="died",
                      message=f"{run.group}:actor rank 0 died")
    for state in ("recovering", "rejoining"):
        run.run_dir.event("recovery_state", state=state, failed_step=2)
    (episode,) = failure_episodes(open_run(str(run.path)).events, "x-run")
    assert (episode.outcome, episode.state) == ("pending", "rejoining")
    code, out, _ = _cli(capsys, "status", str(run.path))
    assert code == 0 and "no recovery recorded: the last state entered is rejoining" in out

def test_a_reused_pid_is_not_the_controller():
    rec = ControllerRecord.for_this_process()
    assert controller_alive(rec) is True
    rec.process_started_at -= 3600  # the recorded controller started an hour before this process
    assert controller_alive(rec) is False


def _local_trainer(tmp_path, hooks=(), roles_factory=None):
    from resilient_rl.config.schema import load_config
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, ["trainer.total_steps=2", "trainer.progress_bar=false", "data.batch_size=8",
                             "data.num_prompts=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                             "actor.ppo_epochs=1", "critic.ppo_epochs=1", "model.hidden_size=32",
                             "model.num_layers=1", "model.intermediate_size=64", "telemetry.enabled=false",
                             f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                             "trainer.run_name=local"])
    return PPOTrainer(cfg, roles_factory=roles_factory or LocalRoles, hooks=list(hooks))


def test_the_trainer_records_its_controller_while_it_runs_and_how_it_ended(tmp_path):
    seen = []

    class Probe(TrainerHook):
        def on_step_start(self, trainer, step):
            seen.append(gather_status(str(trainer.run_dir.path)))

    trainer = _local_trainer(tmp_path, hooks=[Probe()])
    rows = trainer.fit()
    during = seen[-1]
    assert during.state == "running" and during.controller.pid == os.getpid() and during.controller.alive
    assert during.step == 1
    after = gather_status(str(trainer.run_dir.path))
    assert after.state == "finished" and after.step == 2 and after.controller.ended_at is not None
    assert after.useful_s == pytest.approx(sum(r["timing/step_s"] for r in rows))

    def broken_roles(cfg, tokenizer):
        raise RuntimeError("no workers today")
    broken_roles.writes_checkpoints = False

    with pytest.raises(RuntimeError):
        _local_trainer(tmp_path, roles_factory=broken_roles).fit()
    failed = gather_status(str(trainer.run_dir.path))
    assert failed.state == "failed" and failed.detail == "RuntimeError: no workers today"
    assert failed.goodput is None  # training never started


def test_status_names_the_holder_of_the_run_lease(tmp_path, capsys):
    from resilient_rl.checkpoint.leases.run_lease import RunLease

    run = _finished_run(tmp_path)
    lease = RunLease(run.manager.storage, run.name, ttl_s=60)
    lease.acquire()
    try:
        code, out, _ = _cli(capsys, "status", str(run.path))
        assert code == 0 and f"lease:       held by {lease.holder} (token 1)" in out
        s = gather_status(str(run.path)).checkpoint
        assert s.lease_live is True and lease.holder in s.lease
    finally:
        lease.close()
    code, out, _ = _cli(capsys, "status", str(run.path))
    assert f"lease:       last held by {lease.holder} (token 1, released at" in out


def test_status_reports_the_runs_ettr_from_its_ledger(tmp_path, capsys):
    from resilient_rl.telemetry.training_time import write_ledger

    run = _finished_run(tmp_path)
    assert gather_status(str(run.path)).ettr is None  # no ledger (telemetry off): not known
    write_ledger(run.path, {"wall_s": 200.0, "lost_s": {"died": 12.5, "controller": 30.0},
                            "useful": [[11, 140.0], [12, 150.0]], "updated_at": time.time()})
    code, out, err = _cli(capsys, "status", str(run.path), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["ettr"] == pytest.approx(0.75) and s["lost_s"] == {"died": 12.5, "controller": 30.0}
    code, out, _ = _cli(capsys, "status", str(run.path))
    assert "ettr:        75.0% over the run's life (lost: controller 30.0 s, died 12.5 s)" in out


def test_the_readmes_status_sample_is_for_the_run_its_command_names():
    """The sample output under the README's ``status`` command shows that command's run, and
    only lines the reader prints."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Status and plots of a run"):readme.index("## Chaos")]
    blocks = section.split("```")
    command = next(line for line in blocks[1].splitlines() if line.startswith("resilient-rl status"))
    sample = blocks[3].strip("\n").splitlines()
    run = command.split()[2]
    assert sample[0].split()[1] == run, (command, sample[0])
    labels = [line.split(":", 1)[0] for line in sample if line and not line.startswith(" ")]
    assert labels[:3] == ["run", "state", "step"]
    assert set(labels) <= {"run", "state", "step", "checkpoint", "lease", "failures", "goodput", "ettr", "metrics"}
