"""A preempted run (SIGTERM, or Slurm's early SIGUSR1 then SIGTERM) loses and repeats nothing.

``resilient-rl train`` runs as its own process, as under a scheduler; the signal is sent once a
step's metrics row is on disk, so it lands while the next step runs (and, every second step,
while its checkpoint is being written). The process must exit 143 with ``controller.json``
saying ``preempted``, its last completed step committed; the same command then finishes the run
with a metric history and final checkpoint bit-identical to a run never preempted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.faults.harness import collect_run
from resilient_rl.workers.snapshots import carry as snapshot_carry
from resilient_rl.run.folder import deterministic_view
from resilient_rl.workers.snapshots.node_memory import NodeCopy, NodeFiles
from resilient_rl.workers.snapshots.slots import KEEP

pytestmark = pytest.mark.ray

STEPS = 5
ARGS = [f"trainer.total_steps={STEPS}", "trainer.progress_bar=false", "data.batch_size=16", "data.num_prompts=64",
        "actor.mini_batch_size=8", "critic.mini_batch_size=8", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
        "checkpoint.save_every=2", "telemetry.enabled=false", "ray.cpus_per_worker=0.05",
        "recovery.snapshot_every=0"]


def _args(tmp_path, name: str, *extra: str) -> list[str]:
    return [*ARGS, f"trainer.run_name={name}", f"trainer.output_dir={tmp_path / 'runs'}",
            f"checkpoint.root={tmp_path / 'ckpt'}", *extra]


def _train(tmp_path, name: str, *extra: str) -> subprocess.Popen:
    """The CLI in a session of its own: Ray's processes (and so the workers) join its process group."""
    return subprocess.Popen([sys.executable, "-m", "resilient_rl.cli", "-q", "train", *_args(tmp_path, name, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _rows(tmp_path, name: str) -> int:
    path = tmp_path / "runs" / name / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _result(tmp_path, name: str, *extra: str):
    return collect_run(load_config(None, _args(tmp_path, name, *extra)))


@pytest.fixture(scope="module")
def unpreempted(tmp_path_factory):
    base = tmp_path_factory.mktemp("reference")
    proc = _train(base, "ref")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return _result(base, "ref")


def _preempted(tmp_path, name: str, after_rows: int, preempt, *extra: str, ready=lambda: True) -> tuple[str, dict]:
    """Run ``name`` until ``after_rows`` steps are on disk (and ``ready()``), then
    ``preempt(proc)``; its stderr and ``controller.json`` once it exited 143."""
    proc = _train(tmp_path, name, *extra)
    try:
        deadline = time.monotonic() + 600
        while (_rows(tmp_path, name) < after_rows or not ready()) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be preempted"
        preempt(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    record = json.loads((tmp_path / "runs" / name / "controller.json").read_text())
    assert record["state"] == "preempted", record
    return err, record


def _resumed(tmp_path, name: str, unpreempted, *extra: str):
    """Run ``name`` again to its end: every step once, the end bit-identical to ``unpreempted``."""
    resumed = _train(tmp_path, name, *extra)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    result = _result(tmp_path, name, *extra)
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))  # none lost, none repeated
    assert deterministic_view(result.history) == deterministic_view(unpreempted.history)
    assert result.final_files == unpreempted.final_files
    assert result.final_trainer_state == unpreempted.final_trainer_state
    return result


@pytest.mark.parametrize("signals, after_rows", [
    # lands in step 2, whose save is due: stops with that save committed
    pytest.param(("SIGTERM",), 1, marks=pytest.mark.slow),
    (("SIGTERM",), 2),              # lands as step 2's save is being written: waits for it, commits it
    # Slurm: the early warning, then the time limit's SIGTERM (in the default set through a real
    # Slurm: chaos/test_slurm_preemption.py)
    pytest.param(("SIGUSR1", "SIGTERM"), 2, marks=pytest.mark.slow),
])
def test_a_preempted_run_resumes_with_nothing_lost_or_repeated(unpreempted, tmp_path, signals, after_rows):
    name = "preempted"
    log = tmp_path / "runs" / name / "train.log"

    def send(proc):
        deadline = time.monotonic() + 600
        for sig in signals:  # the second one lands as soon as the first is acted on (it is in the log)
            os.kill(proc.pid, getattr(signal, sig))
            while f"{sig} received" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)

    err, record = _preempted(tmp_path, name, after_rows, send)
    stopped_at = record["end_step"]
    assert after_rows <= stopped_at < STEPS and f"preempted by {signals[0]} after step {stopped_at}" in err
    assert f"step {stopped_at} is committed" in err and "Traceback" not in err
    if len(signals) > 1:
        assert f"{signals[1]} received while already stopping for {signals[0]}: ignored" in err
    stopped = _result(tmp_path, name)
    assert stopped.latest == stopped_at and stopped.verify[stopped_at] == "ok"  # the last completed step is durable
    assert [r["step"] for r in stopped.history] == list(range(1, stopped_at + 1))
    claims = sorted((tmp_path / "ckpt" / name / "lease").glob("token_*.json"))
    assert claims and json.loads(claims[-1].read_text())["released"], "the run's lease was left held"

    result = _resumed(tmp_path, name, unpreempted)
    assert [e["step"] for e in result.events_of("checkpoint_restored")] == [stopped_at]


def _preempt_without_warning(proc, order: str) -> None:
    """What a scheduler does with no early warning: SIGTERM to every process of the job (here the
    CLI's session: the CLI, Ray's processes, the workers), the workers gone with it (killed here at
    once; Ray's workers outlive a SIGTERM only until their raylet is gone). The signals land in no
    set order: ``order`` says which come first, in waves 0.3 s apart:

    - ``controller first``: the controller, then at once the workers and Ray's processes;
    - ``controller last``: the workers and Ray's processes, then the controller: the failed step is
      seen with Ray's control plane gone;
    - ``Ray last``: the workers, the controller, then Ray's processes: the failure is seen, and the
      signal lands, with Ray's control plane still up (a recovery begins and must stop)."""
    session = []
    for other in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(other.pid) == proc.pid and other.pid != proc.pid:
                session.append(other)
        except (psutil.Error, ProcessLookupError):
            pass
    # Ray's agents are named ``ray::...Agent`` too; their raylet dies with them.
    workers = [p for p in session if (name := (p.info["cmdline"] or [""])[0]).startswith("ray::")
               and not name.endswith("Agent")]
    ray_procs = [p for p in session if p not in workers]
    controller = [psutil.Process(proc.pid)]
    waves = {"controller first": [controller + workers + ray_procs],
             "controller last": [workers + ray_procs, controller],
             "Ray last": [workers, controller, ray_procs]}[order]
    for i, wave in enumerate(waves):
        if i:
            time.sleep(0.3)
        for other in wave:
            try:
                other.send_signal(signal.SIGTERM)
                if other in workers:
                    other.kill()
            except psutil.Error:
                pass


def _snapshot_in_node_memory(tmp_path, name: str) -> bool:
    """Whether the snapshot of the last step on disk is recorded and every rank's copy of it is
    committed in node memory: the take is done. (A kill during the take loses that snapshot: the
    next controller continues from the one before it, replaying a step; this test is of the other
    case, tests/test_snapshot_node_memory.py of that one.)"""
    newest = snapshot_carry.read(str(tmp_path / "runs" / name / snapshot_carry.RECORD))[:1]
    if not newest or newest[0]["step"] != _rows(tmp_path, name):
        return False
    e = newest[0]
    where = NodeCopy(e["node_dir"], e["id"], any_node=True)
    return all(any(NodeFiles(d, role, rank).has(KEEP, e["step"], e["id"]) for d in where.dirs())
               for role, n in e["world_sizes"].items() for rank in range(n))


# The default set takes the two orders where the failure is seen before the signal.
@pytest.mark.parametrize("order, another_run_between", [pytest.param("controller first", False, marks=pytest.mark.slow),
                                                        ("controller last", False), ("Ray last", True)])
def test_a_preemption_without_warning_continues_from_the_snapshot_left_in_node_memory(unpreempted, tmp_path,
                                                                                     node_memory, order,
                                                                                     another_run_between):
    """Every process of the run signalled, in any order, its workers gone: nothing can be saved, so
    the run is recorded preempted (exit 143, Ray's cluster gone too: nothing waits on it) and leaves
    its newest snapshot in node memory; the same command continues from it, on the same node. No
    completed step is lost or repeated, and the end is bit-identical to a run never preempted,
    although no checkpoint was committed before the signal. Another run that starts and ends on
    the node in between (the preemptor, say) keeps that snapshot for it
    (``recovery.snapshot_hand_over_s``)."""
    name = "unwarned"
    extra = ("checkpoint.save_every=10", "recovery.snapshot_every=1", f"recovery.snapshot_node_dir={node_memory}")
    err, record = _preempted(tmp_path, name, 3, lambda proc: _preempt_without_warning(proc, order), *extra,
                             ready=lambda: _snapshot_in_node_memory(tmp_path, name))
    assert 3 <= record["end_step"] < STEPS, record
    assert "no checkpoint is committed" in err and "left in node memory" in err, err[-3000:]
    left = sorted(os.listdir(node_memory))
    if another_run_between:
        other = _train(tmp_path, "preemptor", *extra[1:], "trainer.total_steps=2")
        out, other_err = other.communicate(timeout=600)
        assert other.returncode == 0, other_err[-3000:]
        assert sorted(os.listdir(node_memory)) == left, "the preemptor's sweeps removed the hand-over"
    result = _resumed(tmp_path, name, unpreempted, *extra)
    assert [e["step"] for e in result.events_of("snapshot_restored")] == [record["end_step"]]
    assert result.events_of("checkpoint_restored") == []
