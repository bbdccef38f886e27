"""What `resilient-rl train` shows on the console, and what goes to ``runs/<run>/train.log`` instead.

The console keeps the progress bar, a summary every ``trainer.log_every`` steps, warnings and the
end; the per-step metrics, the routine lines of every checkpoint and lease (taken, released,
committed, deleted by retention), Ray's start-up notices, everything the workers print and the
ranks' own log records go to the run's ``train.log``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray


def test_worker_output_goes_to_train_log_not_the_console(tmp_path, capfd, monkeypatch):
    import ray

    from resilient_rl.runtime.cluster import connect, disconnect
    from resilient_rl.config.schema import load_config
    from resilient_rl.run.log import RunLog

    cfg = load_config(None, ["ray.num_cpus=2", "ray.object_store_memory=100000000"])
    log = tmp_path / "train.log"
    # A process that started a cluster before has RAY_AUTH_MODE set by Ray, which silences the notice.
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)

    @ray.remote
    def noisy() -> int:
        print("hello from a worker's stdout", flush=True)
        print("Consider using tensor.detach() first (a worker's stderr)", file=sys.stderr, flush=True)
        return 7

    @ray.remote(max_retries=0)
    def dies() -> None:
        os._exit(1)  # Ray's driver then prints "(raylet) A worker died or was killed ..." to stdout

    with RunLog(log):
        owned = connect(cfg.ray)
        try:
            assert ray.get(noisy.remote()) == 7
            from resilient_rl.testing.wait import wait_until

            wait_until(lambda: "a worker's stderr" in log.read_text(), 30,
                       message=lambda: f"the worker's stderr in train.log: {log.read_text()[-2000:]}")
            with pytest.raises(ray.exceptions.WorkerCrashedError):
                ray.get(dies.remote())
            wait_until(lambda: "A worker died" in log.read_text(), 30,
                       message=lambda: f"Ray's worker-died notice in train.log: {log.read_text()[-2000:]}")
        finally:
            disconnect(owned)
    out, err = capfd.readouterr()
    assert "hello from a worker" not in out + err and "a worker's stderr" not in out + err
    assert "A worker died" not in out + err and "(raylet)" not in out + err
    assert "Token authentication" not in out + err
    text = log.read_text()
    assert "INFO resilient_rl.worker_output: (noisy pid=" in text and "hello from a worker's stdout" in text
    assert "WARNING resilient_rl.worker_output: (noisy pid=" in text
    assert "WARNING resilient_rl.worker_output: (raylet) A worker died" in text
    from ray._private import worker as ray_worker

    assert ray_worker.print_to_stdstream.__module__ == "ray._private.worker"  # given back on disconnect
    assert "Token authentication is enabled" in text  # Ray's notice, moved here


def test_train_console_has_a_summary_every_log_every_steps_and_train_log_has_every_step(tmp_path):
    """Checkpoints every step, one kept: each step commits one and deletes one, all off the console."""
    run = tmp_path / "runs" / "console"
    proc = subprocess.run([sys.executable, "-m", "resilient_rl.cli", "train", "trainer.total_steps=4",
                           "trainer.log_every=2", "data.batch_size=16", "actor.mini_batch_size=8",
                           "critic.mini_batch_size=8", "data.num_prompts=64", "checkpoint.save_every=1",
                           "checkpoint.keep_last=1", "recovery.snapshot_every=0",
                           "trainer.run_name=console", f"trainer.output_dir={tmp_path / 'runs'}",
                           f"checkpoint.root={tmp_path / 'ckpt'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    summaries = [part.split("step ", 1)[1].split(" ", 1)[0] for part in console.split("trackers: ")[1:]]
    assert summaries == ["2/4", "4/4"], console[-3000:]
    assert "resilient_rl.steps" not in console and "actor/pg_clipfrac" not in console
    assert "Token authentication" not in console and "(autoscaler" not in console
    assert "mean reward: first 10% of steps" in proc.stdout
    log = (run / "train.log").read_text()
    steps = [line for line in log.splitlines() if "resilient_rl.steps: step " in line]
    assert [s.split("step ")[1].split(" ")[0] for s in steps] == ["1", "2", "3", "4"]
    assert all("actor/pg_clipfrac=" in s and "timing/update_actor_s=" in s for s in steps)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    # The ranks' own INFO records (runtime/worker_logging.py), forwarded to train.log only.
    assert "INFO resilient_rl.runtime.worker: rank 0 joined generation 1" in log
    assert "joined generation" not in console
    routine = ("lease of run", "checkpoint committed", "retention: deleting")
    assert not [line for line in console.splitlines() if any(r in line for r in routine)], console[-3000:]
    for line in routine:
        assert line in log, line
