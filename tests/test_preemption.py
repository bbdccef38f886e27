"""Preemption is an event: the signal is noted, the loop stops at a safe point with its last step
committed, ``controller.json`` says ``preempted`` and the CLI exits 143. The whole path under a
real SIGTERM is in ``chaos/test_preemption_signals.py``; these are its parts, without Ray."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from resilient_rl import cli
from resilient_rl.errors import Preempted, RecoveryError, WorkerDiedError
from resilient_rl.run.record import controller_session
from resilient_rl.trainer.preemption import (Preemption, end_while_stuck, stop_after_lost_cluster,
                                             stop_after_lost_workers, stop_for_preemption, stop_recovering)


def test_a_signal_is_noted_not_acted_on_and_the_handlers_are_given_back():
    before = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption()
    assert preemption.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested and preemption.signal_name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # the later SIGTERM changes nothing: the save goes on
        assert preemption.signal_name == "SIGUSR1"
    finally:
        preemption.restore()
    # Stopping for a preemption: a later signal must not kill the process as it shuts down.
    assert signal.getsignal(signal.SIGUSR1) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, before)
    again = Preemption()
    again.install()
    again.restore()  # no signal: the handlers that were there come back
    assert signal.getsignal(signal.SIGUSR1) == before


class _Checkpoints:
    """The coordinator's part that stopping uses: a save in flight commits when waited for."""

    save_every = 2

    def __init__(self, last_committed, pending=None, commits=True):
        self.last_committed, self.pending, self.commits = last_committed, pending, commits
        self.saved, self.abandoned = [], []

    def wait(self, roles, timeout_s=None):
        if self.pending is not None and self.commits:
            self.last_committed, self.pending = self.pending["step"], None
        return self.pending is None

    def abandon(self, reason):
        self.abandoned.append((self.pending["step"], reason))
        self.pending = None


class _Trainer:
    checkpoints_on = True
    snapshots = None

    def __init__(self, step, ckpt):
        self.step, self.ckpt, self.roles = step, ckpt, object()
        self.preemption = Preemption()
        self.preemption.request("SIGTERM")

    def save_checkpoint(self):
        self.ckpt.saved.append(self.step)
        self.ckpt.pending = {"step": self.step}


@pytest.mark.parametrize("committed, pending, saved", [
    (2, None, [3]),            # step 3 not saved yet: saved now
    (2, {"step": 3}, []),      # the save of step 3 in flight: committed, not saved again
    (3, None, []),             # already durable
])
def test_stopping_makes_the_last_completed_step_durable(committed, pending, saved):
    trainer = _Trainer(3, _Checkpoints(committed, pending))
    with pytest.raises(Preempted, match="preempted by SIGTERM after step 3: step 3 is committed") as info:
        stop_for_preemption(trainer, grace_s=30)
    assert trainer.ckpt.saved == saved and info.value.committed == 3
    assert cli.exit_code(info.value) == cli.EXIT_PREEMPTED == 143


def test_a_save_past_the_grace_period_is_abandoned_and_the_last_commit_named():
    trainer = _Trainer(3, _Checkpoints(2, commits=False))
    with pytest.raises(Preempted, match="after step 3: the last committed checkpoint is step 2"):
        stop_for_preemption(trainer, grace_s=0.01)
    assert trainer.ckpt.abandoned == [(3, "preempted")]


def test_workers_stopped_by_the_same_signal_end_the_run_as_preempted_not_recovered():
    """A requeue with no early warning signals every process: the step fails with its workers.
    Nothing is recovered or saved; the save in flight is abandoned and the last commit named."""
    trainer = _Trainer(3, _Checkpoints(2, pending={"step": 3}))
    died = WorkerDiedError("actor rank 0 died", role="actor", rank=0)
    with pytest.raises(Preempted, match=r"during step 4, whose workers stopped with it: the last committed "
                                        r"checkpoint is step 2; .* \(step 3 is run again\)") as info:
        stop_after_lost_workers(trainer, died)
    assert trainer.ckpt.abandoned == [(3, "preempted")] and trainer.ckpt.saved == []
    assert info.value.committed == 2 and cli.exit_code(info.value) == cli.EXIT_PREEMPTED


class _Keeper:
    """The snapshot keeper's part that stopping uses: it recorded the snapshot of ``step``."""

    def __init__(self, step):
        self.step, self.asked = step, []

    def hand_over_after(self, committed):
        self.asked.append(committed)
        return self.step if committed is None or self.step > committed else None


def test_workers_stopped_by_the_same_signal_leave_the_newest_snapshot_to_the_next_controller():
    """With snapshots recorded for the next controller (workers/snapshots/carry.py), the run's node
    memory is not removed at its end: the next run continues from that snapshot."""
    trainer = _Trainer(3, _Checkpoints(2))
    trainer.snapshots = _Keeper(3)
    with pytest.raises(Preempted, match=r"the newest in-memory snapshot \(step 3\) is left in node memory"):
        stop_after_lost_workers(trainer, WorkerDiedError("actor rank 0 died", role="actor", rank=0))
    assert trainer.snapshots.asked == [2]


def test_a_save_that_fails_with_its_workers_leaves_the_snapshot_of_the_step():
    """The signal reached every process between two steps: the save of the last step fails with
    its workers, so its snapshot is left in node memory, as when a step fails."""
    class Dying(_Checkpoints):
        def wait(self, roles, timeout_s=None):
            raise WorkerDiedError("actor rank 0 died", role="actor", rank=0)

    trainer = _Trainer(3, Dying(None))
    trainer.snapshots = _Keeper(3)
    with pytest.raises(Preempted, match=r"after step 3: no checkpoint is committed.*\(step 3\) is left in node memory"):
        stop_for_preemption(trainer, grace_s=30)
    assert trainer.snapshots.asked == [None]
    trainer = _Trainer(3, _Checkpoints(2))
    trainer.snapshots = _Keeper(3)
    with pytest.raises(Preempted) as info:  # committed: nothing is left
        stop_for_preemption(trainer, grace_s=30)
    assert "node memory" not in str(info.value) and trainer.snapshots.asked == []


def test_a_signal_landing_while_recovering_stops_the_recovery_as_preempted():
    """The workers went down with the job before the controller's own signal landed: the recovery
    it began stops at its next call (the pool's interrupt), as a step that failed after the
    signal does, the newest snapshot left for the next controller."""
    trainer = _Trainer(3, _Checkpoints(2))
    trainer.snapshots = _Keeper(3)
    with pytest.raises(Preempted, match=r"preempted by SIGTERM while recovering step 4: the last committed "
                                        r"checkpoint is step 2.*\(step 3\) is left in node memory") as info:
        stop_recovering(trainer)
    assert info.value.committed == 2 and cli.exit_code(info.value) == cli.EXIT_PREEMPTED
    trainer.preemption = Preemption()  # no signal: the recovery goes on
    stop_recovering(trainer)


def test_a_cluster_gone_without_a_signal_fails_the_run_naming_where_it_continues():
    """Ray's control plane stopped answering with no preemption signal (a lost head node): there is
    nothing to recover on. The run fails at once with the reason, rather than in a call that blocks
    until Ray ends the process with nothing recorded; the snapshot is left as at a preemption."""
    trainer = _Trainer(3, _Checkpoints(2, pending={"step": 3}))
    trainer.preemption = Preemption()
    trainer.snapshots = _Keeper(3)
    died = WorkerDiedError("actor rank 0 died", role="actor", rank=0)
    with pytest.raises(RecoveryError, match=r"step 4 failed \(actor rank 0 died\) and Ray's control plane has not "
                                            r"answered for 20s: the cluster this run was on is gone.* the last "
                                            r"committed checkpoint is step 2.*\(step 3\) is left in node memory"
                       ) as info:
        stop_after_lost_cluster(trainer, died, 20.0)
    assert trainer.ckpt.abandoned == [(3, "cluster lost")] and cli.exit_code(info.value) == cli.EXIT_RECOVERY


def test_checkpoints_turned_off_stay_off():
    ckpt = _Checkpoints(None)
    ckpt.save_every = 0
    with pytest.raises(Preempted, match="after step 3: no checkpoint is committed"):
        stop_for_preemption(_Trainer(3, ckpt), grace_s=30)
    assert ckpt.saved == []


def test_the_controller_record_says_preempted(tmp_path):
    with pytest.raises(Preempted):
        with controller_session(tmp_path, lambda: 7):
            raise Preempted("preempted by SIGTERM after step 7", signal_name="SIGTERM", step=7, committed=7)
    record = json.loads((tmp_path / "controller.json").read_text())
    assert record["state"] == "preempted" and record["end_step"] == 7 and "SIGTERM" in record["reason"]


def test_a_run_ended_from_the_watch_is_recorded_preempted_once_with_its_leases_released(tmp_path):
    """What the signal watch runs when the main thread is stuck: the save in flight abandoned, the
    newest snapshot left in node memory, ``controller.json`` preempted with where the run
    continues, the leases released. The record is marked once: the main thread, should it get out
    of its call and fail, does not overwrite it."""
    from pathlib import Path
    from types import SimpleNamespace

    class Claim:
        released = 0

        def release(self):
            self.released += 1

    trainer = _Trainer(3, _Checkpoints(2, pending={"step": 3}))
    trainer.snapshots, trainer.claim_ = _Keeper(3), Claim()
    trainer.run_dir = SimpleNamespace(path=Path(tmp_path))
    with pytest.raises(Preempted):
        with controller_session(tmp_path, lambda: trainer.step) as record:
            trainer.controller_record = record
            line = end_while_stuck(trainer)
            raise Preempted("the main thread's own end, later", signal_name="SIGTERM", step=3, committed=2)
    assert line == ("preempted by SIGTERM after step 3, the controller stuck in a call that does not return on a "
                    "signal: the last committed checkpoint is step 2; the same command continues from it (step 3 "
                    "is run again); the newest in-memory snapshot (step 3) is left in node memory, where the next "
                    "run continues from it if it starts on the same nodes")
    assert trainer.ckpt.abandoned == [(3, "preempted")] and trainer.claim_.released == 1
    saved = json.loads((tmp_path / "controller.json").read_text())
    assert saved["state"] == "preempted" and saved["end_step"] == 3 and saved["reason"] == line
    assert not record.end(tmp_path, "failed", 3, "RecoveryError: ...")  # marked once
    assert json.loads((tmp_path / "controller.json").read_text()) == saved
    # The other order: the run failed and its end was recorded, then its shutdown got stuck.
    trainer.controller_record.state = "failed"
    assert end_while_stuck(trainer) == ("SIGTERM received after the run ended (failed, recorded in controller.json), "
                                        "the controller stuck in a call that does not return on a signal: exiting")
    assert trainer.claim_.released == 2


class _Tracker:
    """A tracker whose close may hang (its network gone with the job) until ``release`` is set."""

    def __init__(self, hangs=False):
        self.closed, self.release = 0, threading.Event()
        if not hangs:
            self.release.set()

    def log_metrics(self, step, row):
        pass

    def log_event(self, step, kind, fields):
        pass

    def close(self):
        self.release.wait(30)
        self.closed += 1


class _Telemetry:
    stopped = 0

    def stop(self):
        self.stopped += 1


@pytest.mark.parametrize("hangs", [False, True])
def test_a_run_ended_from_the_watch_closes_its_trackers_and_exporter_once_within_a_deadline(tmp_path, monkeypatch,
                                                                                          hangs):
    """The watch's end closes what the main thread's end would have: the trackers (wandb and
    MLflow then show the run ended, with its last rows) and the metrics exporter. A tracker that
    hangs does not hold the exit past ``CLOSE_WITHIN_S``. Closing the trackers again (the main
    thread got out of its call after all) closes none twice."""
    from pathlib import Path
    from types import SimpleNamespace

    from resilient_rl.telemetry.trackers import TrackerSet
    from resilient_rl.trainer import preemption

    monkeypatch.setattr(preemption, "CLOSE_WITHIN_S", 0.2)
    trainer = _Trainer(3, _Checkpoints(3))
    trainer.snapshots, trainer.claim_ = None, SimpleNamespace(release=lambda: None)
    trainer.run_dir = SimpleNamespace(path=Path(tmp_path))
    tracker = _Tracker(hangs)
    trainer.trackers, trainer.telemetry = TrackerSet([tracker]), _Telemetry()
    with controller_session(tmp_path, lambda: trainer.step) as record:
        trainer.controller_record = record
        end_while_stuck(trainer)
        assert json.loads((tmp_path / "controller.json").read_text())["state"] == "preempted"
        assert (tracker.closed, trainer.telemetry.stopped) == ((0, 0) if hangs else (1, 1))
        tracker.release.set()  # the hung close ends after the deadline: it closed the tracker, no one else will
        trainer.trackers.close()
    for _ in range(100):
        if tracker.closed:
            break
        time.sleep(0.05)
    assert tracker.closed == 1


@pytest.mark.parametrize("ends", [False, True])
def test_a_shutdown_stuck_after_a_preemption_still_exits_with_its_code(ends):
    """A shutdown blocked in a call into Ray's control plane, gone with the job (Ray would end the
    process 60 s later with exit code 1): the watchdog exits with the preemption's code instead,
    its output flushed; a shutdown that ends in time cancels it, and the process ends as it would."""
    import subprocess
    import sys

    child = ("import sys, time\n"
             "from resilient_rl.trainer.preemption import Preemption\n"
             "p = Preemption()\n"
             "p.exit_if_stuck(143, within_s=0.5)\n"
             "print('recorded', flush=False)\n"
             + ("p.shutdown_ended()\ntime.sleep(1.0)\n" if ends else "time.sleep(60)\n"))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.stdout == "recorded\n"
    if ends:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 143, done.stderr  # (its sleep would outlast the timeout above)
        assert "did not end within 0.5 s" in done.stderr and "exiting with 143" in done.stderr


_STUCK_CHILD = """
import ctypes, signal, sys, time
from resilient_rl.trainer.preemption import Preemption
from resilient_rl.trainer.signal_watch import POKE
p = Preemption(answer_within_s=2.0)  # a loaded machine still answers within it
p.install(when_stuck=lambda: f"ended from the watch, the run's end recorded ({p.signal_name})", exit_code=143)


def stuck():
    # A native call that does not return on a signal, as one into Ray's control plane once it is
    # gone: the main thread blocks the signals (the process's go to another thread, the watch's
    # poke stays pending) and sleeps in C.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, POKE])
    ctypes.CDLL(None).sleep(60)


print("ready", flush=True)
if sys.argv[1] == "stuck":  # the signal lands during the call (or just before it)
    stuck()
while not p.requested:
    time.sleep(0.01)
if sys.argv[1] == "acted, then stuck":  # the handler ran, then the call blocked before the end was recorded
    stuck()
time.sleep(5.0)  # past answer_within_s, answering the pokes: the watch must not end this run
print("acted on", p.signal_name, flush=True)
"""


@pytest.mark.parametrize("when", ["stuck", "acted, then stuck", "responsive"])
def test_a_signal_the_main_thread_cannot_act_on_still_ends_the_run_as_preempted(tmp_path, when):
    """The signal lands while the main thread is in a native call that does not return on it (a
    call into Ray's control plane gone with the job blocks until Ray ends the process, 60 s later
    with exit code 1), or the main thread acts on it and then enters such a call: the watching
    thread ends the run and exits 143, the main thread's stack in the log. A main thread that
    keeps acting on signals is left to end the run itself."""
    import subprocess
    import sys

    script = tmp_path / "controller.py"
    script.write_text(_STUCK_CHILD)
    child = subprocess.Popen([sys.executable, str(script), when], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if when == "responsive":
        assert child.returncode == 0 and out == "acted on SIGTERM\n", err
        return
    assert child.returncode == 143, err
    assert "resilient-rl: ended from the watch, the run's end recorded (SIGTERM)" in err
    assert "the main thread stopped acting on signals (2 s without an answer)" in err
    assert "ctypes.CDLL(None).sleep(60)" in err and "in stuck" in err  # where it is stuck
