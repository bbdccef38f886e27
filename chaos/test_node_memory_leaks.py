"""Leak nothing, and keep what a run's next controller needs: a controller killed with snapshots on
(the default) leaves its node memory behind; the next run on the node, a different run, keeps it
for the killed run's next controller (``recovery.snapshot_hand_over_s``), removes what no run will
use at its start (a dead rank's reduction segment), and leaves nothing of its own; a sweep once
that keep has passed leaves nothing of either run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from suite import RESULTS, chaos_overrides, ensure_ray
from resilient_rl.config import load_config
from resilient_rl.faults.harness import run_training
from resilient_rl.faults.processes import kill_tree, process_tree
from resilient_rl.testing.wait import wait_until
from resilient_rl.workers.snapshots.node_memory import PREFIX
from resilient_rl.workers.snapshots.node_sweep import holds_snapshot, sweep_runs


def _steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_a_different_run_keeps_a_killed_controllers_snapshot_for_its_keep_and_leaks_nothing(chaos_dir, chaos_ray,
                                                                                         node_memory):
    root = node_memory
    planted = None
    try:
        name = "leak-killed"
        overrides = chaos_overrides(chaos_dir) + [f"trainer.run_name={name}", "trainer.total_steps=40",
                                                  f"recovery.snapshot_node_dir={root}"]
        cmd = [sys.executable, "-m", "resilient_rl.cli", "-q", "train", *overrides]
        proc = subprocess.Popen(cmd, env={**os.environ, "RAY_ADDRESS": ""}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        metrics = Path(chaos_dir) / "runs" / name / "metrics.jsonl"
        try:
            wait_until(lambda: len(_steps(metrics)) >= 3, 300, interval_s=0.05,
                       message=lambda: f"progress of the first controller (exit {proc.poll()})")
            os.kill(proc.pid, signal.SIGSTOP)
            assert kill_tree(process_tree(proc.pid)) == []
        finally:
            if proc.poll() is None:
                kill_tree(process_tree(proc.pid))
        left = [n for n in os.listdir(root) if n.startswith(PREFIX)]
        assert left, "the killed controller's snapshots should still be in node memory"
        # A reduction segment whose creating rank died in set-up (its pid is gone).
        planted = f"/dev/shm/rrl-reduce-{proc.pid}-{uuid.uuid4().hex}"
        Path(planted).write_bytes(b"\0" * 4096)

        assert all(holds_snapshot(os.path.join(root, n)) for n in left), left
        ensure_ray()
        result = run_training(chaos_overrides(chaos_dir) + ["trainer.total_steps=2",
                                                            f"recovery.snapshot_node_dir={root}"], "leak-next")
        RESULTS.append(result)
        assert result.error is None, result.error
        # The start's sweep of other nodes is not waited for (a task on each): give it time.
        wait_until(lambda: not os.path.exists(planted), 60, interval_s=0.2, message=lambda: f"left behind: {planted}")
        assert sorted(os.listdir(root)) == sorted(left), "kept for the killed run's next controller"
        # Once the killed controller's keep (600 s by default) has passed, any sweep removes it.
        later = time.time() + load_config(None, []).recovery.snapshot_hand_over_s + 1
        assert sorted(sweep_runs(root, now=later)) == sorted(os.path.join(root, n) for n in left)
        assert os.listdir(root) == []
    finally:
        if planted and os.path.exists(planted):
            os.unlink(planted)
