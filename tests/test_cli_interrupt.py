"""Ctrl-C on `resilient-rl train` stops the run and leaves no Ray process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from resilient_rl.faults.processes import process_tree
from resilient_rl.testing.wait import wait_until

pytestmark = pytest.mark.ray


def test_ctrl_c_stops_cleanly(tmp_path):
    overrides = ["trainer.total_steps=500", "data.batch_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                 "data.num_prompts=64", f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                 "trainer.run_name=ctrlc", "trainer.progress_bar=false"]
    # Ctrl-C as at a terminal: a suite run in the background (``cmd &``) has SIGINT ignored, and
    # a child would inherit that.
    proc = subprocess.Popen([sys.executable, "-m", "resilient_rl.cli", "-q", "train", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = Path(tmp_path) / "runs" / "ctrlc" / "metrics.jsonl"
    try:
        wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 300,
                   message=lambda: f"two training steps (exit {proc.poll()})")
        tree = process_tree(proc.pid)
        assert len(tree) > 3, "the controller started a local Ray cluster"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at step" in err
    _, alive = psutil.wait_procs(tree[1:], timeout=60)
    assert not [p.pid for p in alive], "every Ray process of the run stopped"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 500
