"""The shipped Slurm recipe, preempted under a real Slurm, resumes with nothing lost or repeated.

A one-node Slurm cluster on loopback (:mod:`resilient_rl.testing.slurm`) runs
``deploy/slurm/train.sbatch`` itself, sized for this CPU machine only through the hooks a user has
(sbatch options, the script's key=value arguments and environment). Once a few steps are on disk
the job gets what ``--signal=B:USR1@<s>`` sends ahead of a time limit: SIGUSR1 to the batch
shell (``scancel --signal=USR1 --batch``). The trainer must commit its last step and exit 143,
the script must requeue the job, and the requeued job, a fresh batch shell that starts Ray again,
must resume the run and finish it: history steps 1..N each once, the restore at the step the
first job committed, and ``controller.json`` saying ``preempted`` and then ``finished``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from resilient_rl.run.folder import RunDir
from resilient_rl.runtime.master_env import free_port
from resilient_rl.testing import slurm
from resilient_rl.testing.wait import wait_until

pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(slurm.missing() is not None, reason=str(slurm.missing()))]

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
RUN = "gsm8k-slurm"  # the script's trainer.run_name
STEPS = 20  # steps take a fraction of a second here: enough that the signal lands mid-run
# A CPU allocation: the script asks for 2 nodes of 8 GPUs and 64 CPUs; a user on other nodes
# overrides the same directives on the sbatch command line.
SBATCH_OPTIONS = ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count() or 1}"]
# The script's trainer arguments: a few small steps, a checkpoint every step, nothing on the
# network but loopback (no metrics server on 0.0.0.0).
OVERRIDES = ["trainer.n_gpus_per_node=null", "actor.world_size=1", f"trainer.total_steps={STEPS}",
             "data.batch_size=4", "actor.mini_batch_size=16", "rollout.max_new_tokens=16",
             "checkpoint.save_every=1", "telemetry.enabled=false", "ray.cpus_per_worker=0.05"]


def _controller(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "controller.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def _preempted(run_dir: Path) -> dict:
    record = _controller(run_dir)
    return record if record.get("state") == "preempted" else {}


# Starting Ray twice and the run's steps take about a minute here; the waits below are bounds for
# a loaded machine, longer together than pytest's default 600 s.
@pytest.mark.timeout(1200)
def test_a_requeued_slurm_job_resumes_the_preempted_run_with_nothing_lost_or_repeated(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    run_dir = shared / "runs" / RUN
    env = {"SHARED": str(shared), "RAY_PORT": str(free_port("127.0.0.1")),
           # The job runs this checkout with this interpreter's environment (sbatch exports it).
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           # The node is shared with other tests' Ray clusters: no dashboard, no fixed client port.
           "RAY_START_ARGS": f"--include-dashboard=false --ray-client-server-port={free_port('127.0.0.1')}"}
    with slurm.SlurmCluster(tmp_path / "slurm") as cluster:
        job = cluster.sbatch([*SBATCH_OPTIONS, f"--chdir={tmp_path}", str(SBATCH), *OVERRIDES], env=env)
        out = tmp_path / f"rrl-{job}.out"  # the script's --output, in the job's working directory

        def log() -> str:
            state = cluster.job(job)
            text = out.read_text(errors="replace")[-4000:] if out.exists() else "(no output yet)"
            return f"job {job} {state.get('JobState')} ({state.get('Reason')}) exit {state.get('ExitCode')}:\n{text}"

        def rows() -> int:
            assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), "the job ended before preemption"
            return len(RunDir(str(shared / "runs"), RUN).read_metrics())

        # A job Slurm cannot place stays pending for ever: fail on that at once, with the reason.
        wait_until(lambda: cluster.job(job)["JobState"] != "PENDING", 60, message=log)
        wait_until(lambda: rows() >= 2, 300, interval_s=0.5, message=log)
        cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])  # what --signal=B:USR1@<s> sends

        # Polled often: once the requeued job starts, controller.json says "running" again.
        preempted = wait_until(lambda: _preempted(run_dir), 240, interval_s=0.2, message=log)
        stopped_at = preempted["end_step"]
        assert 2 <= stopped_at < STEPS, preempted
        # The script requeues the job only when the trainer exited 143: Slurm counts the restart,
        # and the same job id runs the script again.
        wait_until(lambda: int(cluster.job(job).get("Restarts", 0)) >= 1, 120, message=log)

        def ended() -> dict:
            state = cluster.job(job)
            return state if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else {}

        done = wait_until(ended, 600, interval_s=1.0, message=log)
        assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", log()
        assert int(done["Restarts"]) == 1, log()

    record = _controller(run_dir)
    assert record["state"] == "finished" and record["end_step"] == STEPS, record
    folder = RunDir(str(shared / "runs"), RUN)
    assert [r["step"] for r in folder.read_metrics()] == list(range(1, STEPS + 1))  # none lost, none repeated
    restored = [e["step"] for e in folder.read_events() if e["event"] == "checkpoint_restored"]
    assert restored == [stopped_at], restored
    text = out.read_text()  # --open-mode=append: both runs of the job in one file
    assert f"preempted by SIGUSR1 after step {stopped_at}" in text and f"step {stopped_at} is committed" in text
    assert "Traceback" not in text
