"""Write a run folder and its checkpoints the way the trainer does, without training.

For tests of the readers of a run (``status``, ``plot``): :class:`FakeRun` writes metric rows
through :class:`~resilient_rl.run.folder.RunDir` with the trainer's keys, the events that
:class:`~resilient_rl.recovery.driver.Recovery` and the checkpoint coordinator write (same
kinds, same fields, same order) and commits real checkpoints (trainer state only) with
:class:`~resilient_rl.checkpoint.CheckpointManager`. A failure rolls the metric history back to
the restored step exactly as a recovery does, so the replayed steps are written again.
"""

from __future__ import annotations

import math
from pathlib import Path

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.config.file_digests import split_recorded
from resilient_rl.config.schema import config_digest, config_from_dict
from resilient_rl.run.folder import RunDir
from resilient_rl.trainer.resume_check import CONFIG_KEY, checkpoint_config

#: The worker-group name prefix of the colocated group, as ``RayRoles`` names it.
GROUP = "rrl_{run}_a1b2c3_main"


class FakeRun:
    """A run named ``name`` under ``base/runs`` with checkpoints under ``base/ckpt``; ``sections``
    adds config sections (e.g. ``{"data": {...}}``)."""

    def __init__(self, base: Path, name: str = "demo", total_steps: int = 12, save_every: int = 3,
                 step_s: float = 0.5, record_config: bool = True, record_digests: bool = True,
                 sections: dict | None = None):
        self.cfg = config_from_dict({"trainer": {"run_name": name, "output_dir": str(base / "runs"),
                                                 "total_steps": total_steps},
                                     "checkpoint": {"root": str(base / "ckpt"), "save_every": save_every},
                                     **(sections or {})})
        self.name, self.total_steps, self.save_every, self.step_s = name, total_steps, save_every, step_s
        self.record_config = record_config  # False: checkpoints as older versions wrote them (no config)
        # False: the config without its files' content digests, as the versions before them recorded it.
        self.record_digests = record_digests
        self.run_dir = RunDir(self.cfg.trainer.output_dir, name)
        self.run_dir.save_config(self.cfg)
        self.manager = CheckpointManager(self.cfg.checkpoint.root, name, keep_last=100)
        self.step = 0
        self.group = GROUP.format(run=name)

    @property
    def path(self) -> Path:
        return self.run_dir.path

    def row(self, step: int) -> dict:
        """A metrics row with the trainer's keys and smooth made-up values."""
        return {"step": step, "reward/mean": 0.1 + 0.02 * step, "reward/exact_ratio": 0.01 * step,
                "actor/pg_loss": -0.01, "actor/ppo_kl": 0.01 + 0.001 * math.sin(step),
                "actor/reward_kl_penalty": 0.002 * step, "critic/vf_loss": 0.5 / step, "tokens": 512.0,
                "timing/step_s": self.step_s, "timing/gen_s": self.step_s / 2, "perf/tokens_per_s": 512 / self.step_s}

    def train(self, until: int) -> None:
        """Run steps up to ``until``, checkpointing every ``save_every`` steps and at the last step."""
        while self.step < until:
            self.step += 1
            self.run_dir.append_metrics(self.row(self.step))
            if self.step % self.save_every == 0 or self.step == self.total_steps:
                self.checkpoint(self.step)

    def checkpoint(self, step: int) -> None:
        self.manager.begin_step(step)
        recorded = checkpoint_config(self.cfg)
        if not self.record_digests:
            recorded = split_recorded(recorded)[0]
        extra = {CONFIG_KEY: recorded} if self.record_config else {}
        self.manager.write_trainer_state(step, {"step": step, **extra})
        self.run_dir.event("checkpoint_started", step=step, stall_s=0.01)
        self.manager.commit(step, {}, {}, config_digest(self.cfg))
        self.run_dir.event("checkpoint_committed", step=step, duration_s=0.2, stall_s=0.01, bytes=1234)

    def fail(self, role: str = "actor", rank: int = 1, cause: str = "died", recovery_s: float = 4.0,
             hung: bool = False) -> int:
        """The next step fails; recover to the newest checkpoint (or step 0); returns the restored step."""
        failed = self.step + 1
        group = f"{self.group}:{role}"
        self.run_dir.event("failure", step=failed, role=group, rank=rank, cause=cause,
                           message=f"{group} rank {rank} died: the actor is unavailable")
        if hung:
            self.run_dir.event("kill_unresponsive", group=self.group, rank=rank, pid=4242, node="n0")
        self.run_dir.event("worker_restarted", group=self.group, rank=rank, pid=4343, node="n0")
        committed = self.manager.committed_steps()
        restored = committed[-1] if committed else 0
        if committed:
            self.run_dir.event("checkpoint_restored", step=restored, duration_s=0.1,
                               source=self.manager.step_dir(restored))
        self.run_dir.truncate_metrics_after(restored)
        self.step = restored
        self.run_dir.event("recovered", failed_step=failed, restored_step=restored,
                           steps_replayed=max(0, failed - 1 - restored), duration_s=recovery_s,
                           restarted=[[self.group, rank]], generation=2)
        return restored

    def abort(self, role: str = "critic", rank: int = 0) -> None:
        """The next step fails and the failure budget is spent: the run stops."""
        failed = self.step + 1
        group = f"{self.group}:{role}"
        self.run_dir.event("failure", step=failed, role=group, rank=rank, cause="died",
                           message=f"{group} rank {rank} died")
        self.run_dir.event("aborted", reason=f"{group} rank {rank} exceeded max_restarts=0", role=group,
                           rank=rank, last_committed_step=self.manager.latest_step())


def tree_state(path: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every file (content and modification time) and folder under ``path``: equal before and
    after a command that must not have written anything there."""
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(Path(path).rglob("*"))}


def play_two_failures(run: FakeRun) -> FakeRun:
    """Steps 1-12 of ``run`` (checkpoints every 3): actor rank 1 dies at step 8 (restores 6,
    replays 7), a hung critic at step 11 (restores 9, replays 10)."""
    run.train(7)
    run.fail("actor", 1, "died", recovery_s=4.0)
    run.train(10)
    run.fail("critic", 0, "timeout", recovery_s=9.0, hung=True)
    run.train(12)
    return run
