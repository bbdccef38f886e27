"""Experiment trackers (``trainer.loggers``) and the console/``train.log`` split.

Each backend logs a few steps and run events into the run folder and is read back with that
library's own reader (TensorBoard's EventAccumulator, MlflowClient, the offline wandb run file).
The fit loop runs with single-process roles (no Ray); the real CLI run is in test_console_cli.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from resilient_rl.errors import ConfigError
from resilient_rl.config.schema import load_config
from resilient_rl.run.folder import RunDir
from resilient_rl.telemetry.trackers import TrackerSet, _require_extra, build_trackers

RECOVERED = {"failed_step": 4, "restored_step": 2, "steps_replayed": 1, "duration_s": 2.5,
             "restarted": [["actor", 1]], "generation": 2, "source": "checkpoint", "phases": None,
             "rejoined": ["actor"]}
ROWS = [{"step": s, "reward/mean": 0.1 * s, "actor/pg_loss": -0.5 / s, "timing/step_s": 0.2} for s in (1, 2, 3)]


def _cfg(tmp_path, *loggers: str, **extra: str):
    return load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.run_name=trk", "trainer.total_steps=3",
                              f"trainer.loggers=[{','.join(loggers)}]", *(f"{k}={v}" for k, v in extra.items())])


def _log_a_run(cfg) -> RunDir:
    """Three steps, a checkpoint at step 2, a failure at step 4, its recovery to step 2, a replay and a checkpoint."""
    run_dir = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
    trackers = build_trackers(cfg, run_dir)
    try:
        for row in ROWS[:2]:
            trackers.log_metrics(row["step"], row)
        run_dir.event("checkpoint_committed", step=2, duration_s=0.5, stall_s=0.1, bytes=1234)
        trackers.log_metrics(3, ROWS[2])
        run_dir.event("failure", step=4, role="actor", rank=1, cause="died", message="actor rank 1 died")
        run_dir.event("recovered", **RECOVERED)
        trackers.log_metrics(3, ROWS[2])  # replayed
        run_dir.event("checkpoint_committed", step=3, duration_s=0.4, stall_s=0.1, bytes=1234)
    finally:
        trackers.close()
    run_dir.event("checkpoint_started", step=9, stall_s=0.1)  # no longer forwarded
    return run_dir


def test_unknown_logger_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.loggers.*'neptune'"):
        _cfg(tmp_path, "console", "neptune")


def test_a_missing_backend_package_names_the_pip_extra():
    with pytest.raises(ConfigError, match=r"pip install 'resilient-rl\[wandb\]'"):
        _require_extra("resilient_rl_no_such_module", "wandb")


def test_events_reach_subscribers_with_their_step_and_stop_after_close(tmp_path):
    seen = []

    class Recorder:
        def log_metrics(self, step, row):
            seen.append(("metrics", step))

        def log_event(self, step, kind, fields):
            seen.append((kind, step, fields))

        def close(self):
            seen.append(("closed",))

    run_dir = RunDir(str(tmp_path), "r")
    trackers = TrackerSet([Recorder()]).attach(run_dir)
    trackers.log_metrics(5, {"step": 5})
    run_dir.event("checkpoint_started", step=4, stall_s=0.5)
    run_dir.event("recovered", **{**RECOVERED, "failed_step": 6, "restored_step": 4})
    run_dir.event("kill_unresponsive", group="actor", rank=0, pid=42, node=None)
    trackers.close()
    run_dir.event("checkpoint_started", step=8, stall_s=0.5)
    assert seen == [("metrics", 5), ("checkpoint_started", 4, {"step": 4, "stall_s": 0.5}),
                    ("recovered", 6, {**RECOVERED, "failed_step": 6, "restored_step": 4}),
                    ("kill_unresponsive", 5, {"group": "actor", "rank": 0, "pid": 42, "node": None}), ("closed",)]
    assert len(run_dir.events_path.read_text().splitlines()) == 4  # events.jsonl unchanged by subscribers


def test_tensorboard_scalars_and_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _log_a_run(_cfg(tmp_path, "tensorboard"))
    acc = EventAccumulator(str(run_dir.path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.3)]
    assert [e.step for e in acc.Scalars("events/checkpoint_committed")] == [2, 3]
    assert [(e.step, e.value) for e in acc.Scalars("events/recovered")] == [(4, 1.0)]
    texts = acc.Tensors("events/failure/text_summary")
    assert texts and texts[0].step == 4
    assert '"role": "actor"' in texts[0].tensor_proto.string_val[0].decode()


def test_wandb_offline_run_holds_metrics_and_events(tmp_path, monkeypatch):
    from resilient_rl.testing.wandb_offline import find_run_file, read_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _log_a_run(_cfg(tmp_path, "wandb"))
    rows = read_history(find_run_file(run_dir.path))
    steps = [(r["trainer/step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    assert [(s, round(v, 6)) for s, v in steps] == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.3)]
    events = {k: r["trainer/step"] for r in rows for k in r if k.startswith("events/")}
    assert events == {"events/checkpoint_committed": 3, "events/failure": 4, "events/recovered": 4}
    tables = [r for r in rows if "event_log/path" in r]
    assert [t["event_log/nrows"] for t in tables] == [2, 3, 4]  # checkpoints wait for the next event or close
    table = json.loads((find_run_file(run_dir.path).parent / "files" / tables[-1]["event_log/path"]).read_text())
    assert [row[:2] for row in table["data"]] == [[2, "checkpoint_committed"], [4, "failure"], [4, "recovered"],
                                                  [3, "checkpoint_committed"]]
    assert json.loads(table["data"][2][2]) == RECOVERED


def test_mlflow_file_store_holds_metrics_and_events(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = _log_a_run(_cfg(tmp_path, "mlflow", **{"trainer.project_name": "rrl-test"}))
    client = MlflowClient(tracking_uri=(run_dir.path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("rrl-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "trk" and run.info.status == "FINISHED"
    assert run.data.params["trainer.loggers"] == "['mlflow']"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.3)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "events/recovered")] == [(4, 1.0)]
    local = client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path))
    kinds = [json.loads(line)["event"] for line in Path(local).read_text().splitlines()]
    assert kinds == ["checkpoint_committed", "failure", "recovered", "checkpoint_committed"]


def test_the_event_log_holds_the_newest_events_and_the_counts_count_all(tmp_path, monkeypatch):
    """The wandb table and the MLflow artifact are rewritten whole: a week-long run keeps only the
    newest EVENT_LOG_ROWS events in them (and in memory); events.jsonl keeps them all."""
    from mlflow import MlflowClient

    from resilient_rl.telemetry import trackers
    from resilient_rl.testing.wandb_offline import find_run_file, read_history

    monkeypatch.setattr(trackers, "EVENT_LOG_ROWS", 2)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = _log_a_run(_cfg(tmp_path, "wandb", "mlflow", **{"trainer.project_name": "rrl-test"}))
    assert len(run_dir.events_path.read_text().splitlines()) == 5  # with the one after close
    rows = read_history(find_run_file(run_dir.path))
    assert [t["event_log/nrows"] for t in rows if "event_log/path" in t] == [2, 2, 2]  # 2, 3, 4 unbounded
    assert max(r.get("events/checkpoint_committed", 0) for r in rows) == 2
    client = MlflowClient(tracking_uri=(run_dir.path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rrl-test").experiment_id])
    local = client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path))
    assert [json.loads(line)["event"] for line in Path(local).read_text().splitlines()] == [
        "recovered", "checkpoint_committed"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "events/checkpoint_committed")] == [1, 2]


def test_fit_prints_a_summary_every_log_every_steps_and_the_full_log_to_train_log(tmp_path, capsys):
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer
    from resilient_rl.run.log import TqdmConsoleHandler, setup_console

    cfg = load_config(None, ["trainer.total_steps=5", "trainer.log_every=2", "data.batch_size=8", "data.num_prompts=16",
                             "actor.mini_batch_size=8", "critic.mini_batch_size=8", "actor.ppo_epochs=1",
                             "critic.ppo_epochs=1", "model.hidden_size=32", "model.num_layers=1",
                             "model.intermediate_size=64", "telemetry.enabled=false",
                             f"trainer.output_dir={tmp_path}", "trainer.run_name=console"])
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    setup_console(logging.INFO)  # as the CLI does, onto the captured stderr
    try:
        PPOTrainer(cfg, roles_factory=LocalRoles).fit()
    finally:
        root.handlers[:] = [h for h in saved[0]]
        root.setLevel(saved[1])
        # Other tests' CLI runs may have installed a console handler before this one: only ours goes.
        assert sum(isinstance(h, TqdmConsoleHandler) for h in root.handlers) == \
            sum(isinstance(h, TqdmConsoleHandler) for h in saved[0])
    err = capsys.readouterr().err
    summaries = [line for line in err.splitlines() if "resilient_rl.telemetry.trackers: step " in line]
    assert [s.split("step ")[1].split(" ")[0] for s in summaries] == ["2/5", "4/5", "5/5"]
    assert "reward" in summaries[0] and "s/step" in summaries[0]
    assert "resilient_rl.steps" not in err
    log = (tmp_path / "console" / "train.log").read_text()
    steps = [line for line in log.splitlines() if "resilient_rl.steps: step " in line]
    assert len(steps) == 5 and all("critic/vf_loss=" in s and "perf/tokens_per_s=" in s for s in steps)
    assert log.count("resilient_rl.telemetry.trackers: step ") == 3
    assert len((tmp_path / "console" / "metrics.jsonl").read_text().splitlines()) == 5


def test_run_log_is_reentrant_and_routes_worker_lines(tmp_path, capsys):
    from resilient_rl.run.log import QUIET_RAY_LOGGERS, RunLog
    from resilient_rl.runtime.worker_output import _log_worker_lines

    root = logging.getLogger()
    before = list(root.handlers)
    path = tmp_path / "train.log"
    line = {"lines": ["boom"], "pid": 42, "ip": "10.0.0.1", "actor_name": "actor_0", "is_err": True}
    with RunLog(path):
        with RunLog(path):  # the CLI's and fit()'s: one file handler
            assert len(root.handlers) == len(before) + 1
            _log_worker_lines(line)
            _log_worker_lines({**line, "lines": ["hello"], "is_err": False})
        assert len(root.handlers) == len(before) + 1
        assert not logging.getLogger(QUIET_RAY_LOGGERS[0]).propagate
    assert root.handlers == before and logging.getLogger(QUIET_RAY_LOGGERS[0]).propagate
    text = path.read_text()
    assert "WARNING resilient_rl.worker_output: (actor_0 pid=42, 10.0.0.1) boom" in text
    assert "INFO resilient_rl.worker_output: (actor_0 pid=42, 10.0.0.1) hello" in text
    assert "boom" not in capsys.readouterr().err
    _log_worker_lines(line)  # no run log open: printed, as Ray would, not lost
    assert "(actor_0 pid=42, 10.0.0.1) boom" in capsys.readouterr().err


def test_train_log_is_rotated_and_keeps_the_newest_parts(tmp_path, monkeypatch):
    from resilient_rl.run import log

    monkeypatch.setattr(log, "ROTATE_BYTES", 4000)
    monkeypatch.setattr(log, "KEEP_ROTATED", 2)
    path = tmp_path / "train.log"
    with log.RunLog(path):
        for i in range(200):
            log.STEP_LOG.info("step %d %s", i, "x" * 80)
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == ["train.log", "train.log.1", "train.log.2"]
    assert all((tmp_path / p).stat().st_size <= 4000 for p in parts)
    assert "step 199 " in path.read_text() and "step 0 " not in "".join((tmp_path / p).read_text() for p in parts)


def test_a_chosen_backend_that_is_not_installed_fails_before_anything_starts(tmp_path, monkeypatch):
    from resilient_rl.telemetry import trackers
    from resilient_rl.trainer.ppo import PPOTrainer

    monkeypatch.setitem(trackers.PACKAGES, "wandb", "resilient_rl_no_such_package")
    with pytest.raises(ConfigError, match=r"'wandb'.*pip install 'resilient-rl\[wandb\]'"):
        PPOTrainer(_cfg(tmp_path, "console", "wandb"))
    assert not (tmp_path / "trk").exists()  # no run folder, no workers


def test_optional_backends_are_imported_only_when_chosen(tmp_path):
    """The default loggers run a fit without importing tensorboard, wandb or mlflow (slow, heavy imports)."""
    code = f"""
import sys
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.trainer.ppo import PPOTrainer
cfg = load_config(None, ["trainer.total_steps=1", "data.batch_size=8", "data.num_prompts=8",
                         "actor.mini_batch_size=8", "critic.mini_batch_size=8", "model.hidden_size=16",
                         "model.num_layers=1", "model.intermediate_size=32", "telemetry.enabled=false",
                         "trainer.output_dir={tmp_path}", "trainer.run_name=plain"])
assert cfg.trainer.loggers == ["console", "jsonl"], cfg.trainer.loggers
PPOTrainer(cfg, roles_factory=LocalRoles).fit()
print(sorted(m for m in ("tensorboard", "torch.utils.tensorboard", "wandb", "mlflow") if m in sys.modules))
"""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "plain" / "metrics.jsonl").exists()
