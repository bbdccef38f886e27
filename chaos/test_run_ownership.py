"""One run, one writer; resume means what it says.

- The same command started again while the controller still runs is refused, naming the holder,
  and the running controller ends as if nothing had happened.
- A hung controller (SIGSTOP) loses the run once its lease expires; a second controller takes it
  over and finishes it; when the first one wakes up it stops on the lost lease, and the second
  one's checkpoints are intact and equal to the fault-free run's.
- A run resumed from an earlier step of its own keeps that timeline: a worker killed before its
  first new commit makes recovery restore that step again (not the newer, abandoned steps), and
  the run ends identical to the fault-free run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from suite import chaos_overrides
from resilient_rl.checkpoint import Storage
from resilient_rl.checkpoint.leases.run_lease import read_lease
from resilient_rl.errors import LeaseHeldError
from resilient_rl.faults.harness import check_invariants, collect_run, run_training
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.faults.processes import kill_tree, process_tree
from resilient_rl.config.schema import load_config
from resilient_rl.testing.wait import wait_until
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.trainer.hooks import TrainerHook


def _steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


class _SecondController(TrainerHook):
    """At the start of step 3, runs the same config again in this process: it must be refused."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.error: BaseException | None = None

    def on_step_start(self, trainer, step):
        if step != 3 or self.error is not None:
            return
        second = PPOTrainer(self.cfg)
        try:
            second.start_roles()
        except LeaseHeldError as exc:
            self.error = exc
        finally:
            second.shutdown()


def test_second_controller_on_a_live_run_is_refused(reference, chaos_ray, chaos_dir):
    name = "second-controller"
    probe = _SecondController(load_config(None, chaos_overrides(chaos_dir) + [f"trainer.run_name={name}"]))
    result = run_training(chaos_overrides(chaos_dir), name, hooks=(probe,))
    assert isinstance(probe.error, LeaseHeldError), "the second controller was not refused"
    message = str(probe.error)
    assert f"{os.getpid()}:" in message and "until" in message and "checkpoint.takeover=true" in message
    check_invariants(result, reference, expect_recoveries=0)
    assert len(result.events_of("lease_acquired")) == 1
    assert read_lease(Storage(f"{chaos_dir}/ckpt"), name).released


@pytest.mark.slow  # takeover and self-fencing are unit-tested in tests/test_lease*.py
def test_hung_controller_is_taken_over_and_stops_when_it_wakes(reference, chaos_dir, chaos_ray):
    name = "hung-controller"
    overrides = chaos_overrides(chaos_dir) + [f"trainer.run_name={name}", "checkpoint.lease_ttl_s=6",
                                              "checkpoint.lease_renew_s=1"]
    cmd = [sys.executable, "-m", "resilient_rl.cli", "-q", "train", *overrides]
    env = {**os.environ, "RAY_ADDRESS": ""}
    metrics = Path(chaos_dir) / "runs" / name / "metrics.jsonl"
    latest = Path(chaos_dir) / "ckpt" / name / "latest"
    storage = Storage(f"{chaos_dir}/ckpt")

    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: latest.exists() and len(_steps(metrics)) >= 3, 300,
                   message=lambda: f"progress of the first controller (exit {first.poll()})")
        held = read_lease(storage, name)
        assert held is not None and held.pid == first.pid and held.live(time.time())
        os.kill(first.pid, signal.SIGSTOP)  # hung: neither steps nor lease renewals
        stopped_at = max(_steps(metrics))
        assert stopped_at < 6
        wait_until(lambda: not read_lease(storage, name).live(time.time()), 60,
                   message="the stopped controller's lease to expire")

        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert second.returncode == 0, second.stderr[-2000:]
        taken = read_lease(storage, name)
        assert taken.token == held.token + 1 and taken.previous["holder"] == held.holder and taken.released
        result = collect_run(load_config(None, overrides))
        committed_before = {s: storage.read_bytes(f"{name}/step_{s:08d}/MANIFEST.json") for s in result.committed}

        os.kill(first.pid, signal.SIGCONT)  # it wakes up and finds the run taken over
        _, err = first.communicate(timeout=300)
        assert first.returncode == 2, err[-2000:]
        assert "was taken over by" in err and taken.holder in err, err[-2000:]
    finally:
        if first.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first.pid, signal.SIGCONT)
            kill_tree(process_tree(first.pid))
    # Nothing of the second controller's run was touched by the first one.
    after = collect_run(load_config(None, overrides))
    assert after.committed == result.committed
    assert {s: storage.read_bytes(f"{name}/step_{s:08d}/MANIFEST.json") for s in after.committed} == committed_before
    assert all(json.loads(committed_before[s]).get("fencing_token") == taken.token
               for s in after.committed if s > stopped_at)
    check_invariants(after, reference, expect_recoveries=0)


@pytest.mark.slow
def test_resume_from_an_earlier_step_survives_a_failure_before_its_first_commit(reference, chaos_run, chaos_dir):
    name = "resume-earlier"
    first = chaos_run(None, "trainer.total_steps=4", name=name)  # commits steps 2 and 4
    assert first.error is None and first.committed == [2, 4]
    step_2 = f"{chaos_dir}/ckpt/{name}/step_00000002"
    schedule = FaultSchedule().at_step(3).kill("actor", 1)  # before the resumed run commits anything
    result = chaos_run(schedule, f"checkpoint.resume=path:{step_2}", name=name)
    check_invariants(result, reference)
    assert [e["steps"] for e in result.events_of("checkpoints_set_aside")] == [[4]]
    assert [e["restored_step"] for e in result.events_of("recovered")] == [2], "recovery kept the resumed timeline"
    abandoned = Path(chaos_dir) / "ckpt" / name / "abandoned"
    assert [p.name for p in abandoned.glob("*/step_*")] == ["step_00000004"], "the abandoned step was kept aside"
