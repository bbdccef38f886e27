"""The controller dies (SIGKILL, with the local cluster it started); the same command resumes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from suite import chaos_overrides
from resilient_rl.faults.harness import check_invariants, collect_run
from resilient_rl.config.schema import load_config
from resilient_rl.faults.processes import kill_tree, process_tree
from resilient_rl.testing.wait import wait_until


def _steps(path: Path) -> list[int]:
    """The steps of the complete lines of a metrics file that is being written (polled every
    10 ms, it can end in the part of a line written so far)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line)["step"] for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def test_controller_killed_and_started_again_resumes(reference, chaos_dir, chaos_ray):
    name = "controller-restart"
    overrides = chaos_overrides(chaos_dir) + [f"trainer.run_name={name}"]
    cmd = [sys.executable, "-m", "resilient_rl.cli", "-q", "train", *overrides]
    env = {**os.environ, "RAY_ADDRESS": ""}
    metrics = Path(chaos_dir) / "runs" / name / "metrics.jsonl"
    latest = Path(chaos_dir) / "ckpt" / name / "latest"

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Polled often and frozen at once: a step takes a few tens of milliseconds, and the run
        # must still have steps to go when it dies.
        wait_until(lambda: latest.exists() and len(_steps(metrics)) >= 3, 300, interval_s=0.01,
                   message=lambda: f"progress of the first controller (exit {proc.poll()})")
        os.kill(proc.pid, signal.SIGSTOP)
        tree = process_tree(proc.pid)
        assert len(tree) > 1, "the controller runs its own local Ray cluster"
        assert kill_tree(tree) == [], "every process of the killed controller and its cluster is gone"
    finally:
        if proc.poll() is None:
            kill_tree(process_tree(proc.pid))
    killed_at = max(_steps(metrics))
    assert killed_at < 6

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    result = collect_run(load_config(None, overrides))
    # From its last checkpoint, or from the snapshot the first left in node memory where every rank
    # still finds its copy there (whether the first sealed it before it died is a matter of timing).
    assert [e for e in result.events if e["event"] in ("checkpoint_restored", "snapshot_restored")], \
        "the second controller resumed"
    check_invariants(result, reference, expect_recoveries=0)
    # ETTR spans both controllers: the second continued the first's ledger, and the pause between
    # them (and any step trained again) is lost to the crashed controller.
    ledger = json.loads((Path(chaos_dir) / "runs" / name / "ettr.json").read_text())
    total = load_config(None, overrides).trainer.total_steps
    assert ledger["useful"][-1][0] == total
    assert ledger["lost_s"]["controller"] > 0 and ledger["wall_s"] > ledger["useful"][-1][1]


def test_a_rank_killed_while_a_resumed_run_loads_its_checkpoint_is_recovered(reference, chaos_run, monkeypatch):
    """A run stops after step 4 (its checkpoints committed); the next controller resumes it, and a
    rank dies as the checkpoint is loaded into the roles, before any step: the recovery repairs the
    pool and loads the same checkpoint, and the run ends as the fault-free one (it stopped instead,
    a failure outside the step loop that nothing recovered)."""
    import time

    from resilient_rl.checkpoint.restore import Restorer
    from resilient_rl.faults.injectors import role_pids

    name = "resume-load-kill"
    first = chaos_run(None, "trainer.total_steps=4", name=name)
    assert first.error is None and first.committed == [2, 4], (first.error, first.committed)
    restore, killed = Restorer.restore, []

    def kill_then_restore(self, roles, resume="auto"):
        if not killed:
            pid = role_pids(roles)[("actor", 1)]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            time.sleep(0.5)  # dead before the load reaches it
        return restore(self, roles, resume)

    monkeypatch.setattr(Restorer, "restore", kill_then_restore)
    result = chaos_run(None, name=name)
    assert killed, "the kill did not happen during the resume's load"
    check_invariants(result, reference)
    recovered = result.events_of("recovered")
    assert recovered and recovered[0]["restored_step"] == 4 and recovered[0]["steps_replayed"] == 0
