"""The shipped Slurm recipe, preempted under a real Slurm, resumes with nothing lost or repeated.

A one-node Slurm cluster on loopback (:mod:`resilient_rl.testing.slurm`) runs
``deploy/slurm/train.sbatch`` itself, sized for this CPU machine only through the hooks a user has
(sbatch options, the script's key=value arguments and environment). Once a few steps are on disk
the job gets what ``--signal=B:USR1@<s>`` sends ahead of a time limit: SIGUSR1 to the batch
shell (``scancel --signal=USR1 --batch``). The trainer must commit its last step and exit 143,
the script must requeue the job, and the requeued job, a fresh batch shell that starts Ray again,
must resume the run and finish it: history steps 1..N each once, the restore at the step the
first job committed, and ``controller.json`` saying ``preempted`` and then ``finished``.

A cluster can also preempt with no warning (``scontrol requeue``, a preemption by a job of higher
priority, a time limit without ``--signal``): Slurm then sends SIGTERM to every process of the job,
Ray's own included, and SIGKILL to what is left after ``KillWait`` (30 s by default). Nothing can
be saved then; the slow case below checks that the run is recorded as preempted and that the
requeued job, on the same node, continues from the snapshot the first left in node memory
(checkpoints every 5 steps there): nothing completed is lost or repeated.
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


def _job_env(shared: Path) -> dict[str, str]:
    """What the test sets in the job's environment (sbatch exports the submitter's)."""
    return {"SHARED": str(shared), "RAY_PORT": str(free_port("127.0.0.1")),
            # The job runs this checkout with this interpreter's environment.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            # The node is shared with other tests' Ray clusters: no dashboard, no fixed client port.
            "RAY_START_ARGS": f"--include-dashboard=false --ray-client-server-port={free_port('127.0.0.1')}"}


class TrainJob:
    """The recipe submitted to ``cluster`` from ``tmp_path``, its run folder under ``tmp_path/shared``."""

    def __init__(self, cluster: slurm.SlurmCluster, tmp_path: Path, *extra: str) -> None:
        self.cluster = cluster
        shared = tmp_path / "shared"
        shared.mkdir()
        self.runs = shared / "runs"
        self.run_dir = self.runs / RUN
        self.env = _job_env(shared)
        self.id = cluster.sbatch([*SBATCH_OPTIONS, f"--chdir={tmp_path}", str(SBATCH), *OVERRIDES, *extra],
                                 env=self.env)
        self.out = tmp_path / f"rrl-{self.id}.out"  # the script's --output, in the job's working directory

    def state(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def log(self) -> str:
        """The job's state and the end of its output, for a failed wait or assertion."""
        state = self.state()
        text = self.out.read_text(errors="replace")[-4000:] if self.out.exists() else "(no output yet)"
        return f"job {self.id} {state.get('JobState')} ({state.get('Reason')}) exit {state.get('ExitCode')}:\n{text}"

    def rows(self) -> int:
        assert self.state()["JobState"] in ("PENDING", "RUNNING"), "the job ended before preemption"
        return len(RunDir(str(self.runs), RUN).read_metrics())

    def wait_for_steps(self, n: int) -> None:
        # A job Slurm cannot place stays pending for ever: fail on that at once, with the reason.
        wait_until(lambda: self.state()["JobState"] != "PENDING", 60, message=self.log)
        wait_until(lambda: self.rows() >= n, 300, interval_s=0.5, message=self.log)

    def wait_for_end(self) -> dict[str, str]:
        """The job's fields once it ended after one requeue; it must have completed with exit 0."""
        wait_until(lambda: int(self.state().get("Restarts", 0)) >= 1, 120, message=self.log)

        def ended() -> dict:
            state = self.state()
            return state if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else {}

        done = wait_until(ended, 600, interval_s=1.0, message=self.log)
        assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", self.log()
        assert int(done["Restarts"]) == 1, self.log()
        # `ray start` left the job's address in Ray's temp dir; the script removed it, or a later
        # ray.init() with no address on this node would try to join the dead cluster.
        temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        address_file = Path(temp) / "ray" / "ray_current_cluster"
        left = address_file.read_text() if address_file.exists() else ""
        assert not left.endswith(f":{self.env['RAY_PORT']}"), f"{address_file} still names the job's cluster {left}"
        return done

    def check_resumed(self, restored_at: int, events: tuple[str, ...] = ("checkpoint_restored",)) -> None:
        """The run finished, every step once in its history, restored once at ``restored_at``
        (from a checkpoint, or as ``events`` say)."""
        record = _controller(self.run_dir)
        assert record["state"] == "finished" and record["end_step"] == STEPS, record
        folder = RunDir(str(self.runs), RUN)
        assert [r["step"] for r in folder.read_metrics()] == list(range(1, STEPS + 1))  # none lost, none repeated
        restored = [e["step"] for e in folder.read_events() if e["event"] in events]
        assert restored == [restored_at], restored


# Starting Ray twice and the run's steps take about a minute here; the waits are bounds for a
# loaded machine, longer together than pytest's default 600 s.
@pytest.mark.timeout(1200)
def test_a_requeued_slurm_job_resumes_the_preempted_run_with_nothing_lost_or_repeated(tmp_path):
    with slurm.SlurmCluster(tmp_path / "slurm") as cluster:
        job = TrainJob(cluster, tmp_path)
        job.wait_for_steps(2)
        cluster.run(["scancel", "--signal=USR1", "--batch", str(job.id)])  # what --signal=B:USR1@<s> sends
        # Polled often: once the requeued job starts, controller.json says "running" again.
        preempted = wait_until(lambda: _preempted(job.run_dir), 240, interval_s=0.2, message=job.log)
        stopped_at = preempted["end_step"]
        assert 2 <= stopped_at < STEPS, preempted
        # The script requeues the job only when the trainer exited 143; Slurm counts the restart.
        job.wait_for_end()
    job.check_resumed(stopped_at)
    text = job.out.read_text()  # --open-mode=append: both runs of the job in one file
    assert f"preempted by SIGUSR1 after step {stopped_at}" in text and f"step {stopped_at} is committed" in text
    assert "Traceback" not in text


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_job_requeued_without_warning_continues_from_the_snapshot_left_in_node_memory(tmp_path):
    with slurm.SlurmCluster(tmp_path / "slurm") as cluster:
        job = TrainJob(cluster, tmp_path, "checkpoint.save_every=5")
        job.wait_for_steps(7)
        first = _controller(job.run_dir)
        cluster.run(["scontrol", "requeue", str(job.id)])

        def stopped() -> dict:  # recorded as stopped, or already replaced by the requeued job's record
            record = _controller(job.run_dir)
            return record if record.get("state") not in (None, "running") or record.get("pid") != first["pid"] else {}

        record = wait_until(stopped, 240, interval_s=0.2, message=job.log)
        assert record.get("pid") == first["pid"] and record["state"] == "preempted", record
        job.wait_for_end()
    # From the snapshot (or from the checkpoint where the preemption came just after a commit).
    job.check_resumed(record["end_step"], events=("snapshot_restored", "checkpoint_restored"))
