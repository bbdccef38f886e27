"""Leak nothing: a controller killed with snapshots on (the default) leaves its node memory behind;
the next run on the node, a different run, removes it at its start, and nothing of either run is
left once it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from suite import RESULTS, chaos_overrides, ensure_ray
from resilient_rl.faults.harness import run_training
from resilient_rl.faults.processes import kill_tree, process_tree
from resilient_rl.testing.wait import wait_until
from resilient_rl.workers.snapshots.node_memory import PREFIX


def _steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_killed_controller_then_a_different_run_leaves_no_bytes_behind(chaos_dir, chaos_ray):
    root = f"/dev/shm/rrl-chaos-leak-{uuid.uuid4().hex[:8]}"
    os.makedirs(root)
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

        ensure_ray()
        result = run_training(chaos_overrides(chaos_dir) + ["trainer.total_steps=2",
                                                            f"recovery.snapshot_node_dir={root}"], "leak-next")
        RESULTS.append(result)
        assert result.error is None, result.error
        # The start's sweep is not waited for (it runs as a task on every node): give it time.
        wait_until(lambda: os.listdir(root) == [] and not os.path.exists(planted), 60, interval_s=0.2,
                   message=lambda: f"left behind: {os.listdir(root)}, {planted}: {os.path.exists(planted)}")
    finally:
        subprocess.run(["rm", "-rf", root])
        if planted and os.path.exists(planted):
            os.unlink(planted)
