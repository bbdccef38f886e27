"""The PPO/GRPO fit loop driven by the single controller.

The controller owns the data loader, the KL controller, the step counter and the run folder;
the roles (Ray worker groups, or local engines for the single-process baseline) own the models.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np

from resilient_rl.algos.kl import get_kl_controller
from resilient_rl.errors import CheckpointCorruptError, WorkerError
from resilient_rl.models.factory import model_vocab_size
from resilient_rl.trainer.checkpointing import CheckpointCoordinator
from resilient_rl.trainer.controller_state import Attribute, ControllerState
from resilient_rl.trainer.pool import WorkerPool
from resilient_rl.config.schema import config_digest
from resilient_rl.trainer.controller_record import controller_session
from resilient_rl.data.loader import PromptDataset, StatefulPromptLoader
from resilient_rl.trainer.nonfinite import NonFiniteGuard
from resilient_rl.trainer.resilience import Recovery
from resilient_rl.trainer.run_dir import RunDir
from resilient_rl.trainer.run_log import RunLog
from resilient_rl.trainer.snapshots import SnapshotKeeper
from resilient_rl.workers.node_sweep import sweep_every_node
from resilient_rl.workers.shm_reduce import SHM_DIR
from resilient_rl.trainer.step import PHASES, run_step
from resilient_rl.data.tasks import get_task
from resilient_rl.trainer.telemetry_hook import TelemetryHook
from resilient_rl.data.tokenizer import build_tokenizer
from resilient_rl.trainer.trackers import build_trackers, check_available

logger = logging.getLogger(__name__)

#: Rows of the metric history kept in memory (``PPOTrainer.history``); the whole history is in
#: the run folder's ``metrics.jsonl``, so a week-long run does not grow the controller.
HISTORY_WINDOW = 1000


def reward_summary(rows: Sequence[dict] | Sequence[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last 10% of steps (at least one step each); ``rows``
    are metric rows or their ``reward/mean`` values (``RunDir.read_column("reward/mean")``)."""
    rewards = [r["reward/mean"] if isinstance(r, dict) else r for r in rows]
    k = max(1, len(rewards) // 10)
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))


class PPOTrainer:
    """Runs ``cfg.trainer.total_steps`` steps of PPO (GAE) or GRPO."""

    def __init__(self, cfg, roles_factory: Callable | None = None, hooks: list | None = None):
        self.cfg = cfg
        self.task = get_task(cfg.data)
        self.tokenizer = build_tokenizer(cfg.data, self.task)
        model_vocab_size(cfg.model, self.tokenizer.vocab_size)  # fail here, not in a worker, if too small
        self.dataset = PromptDataset.from_config(cfg.data, self.tokenizer)
        self.dataset.check_fits(cfg.model.max_seq_len, cfg.rollout.max_new_tokens)
        self.loader = StatefulPromptLoader.from_config(self.dataset, cfg.data)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.step = 0
        check_available(cfg.trainer.loggers)
        self.run_dir = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
        self.run_dir.save_config(cfg)
        self.digest = config_digest(cfg)
        self.hooks = list(hooks or [])
        if roles_factory is None:
            from resilient_rl.trainer.ray_roles import RayRoles

            roles_factory = RayRoles
        self._roles_factory = roles_factory
        self.roles: WorkerPool | None = None
        self.history: deque[dict] = deque(maxlen=HISTORY_WINDOW)  # the newest rows
        self.trackers = None  # the trainer.loggers backends, open while fit() runs
        self.telemetry = (TelemetryHook(cfg, self.run_dir, self.run_dir.subscribe) if cfg.telemetry.enabled
                          else None)
        self.ckpt = CheckpointCoordinator(cfg, on_event=self.run_dir.event, metrics=self.telemetry)
        self.ckpt.prepare()  # an unwritable checkpoint root fails here, before any worker starts
        self.nonfinite = NonFiniteGuard(self)
        self.run_dir.subscribe(self.nonfinite.on_checkpoint_event)
        self.run_dir.subscribe(self._on_event)
        self.recovery = Recovery(cfg.recovery, pool=lambda: self.roles, checkpoints=self.ckpt,
                                 restore=self.restore_after_failure, emit=self.run_dir.event,
                                 on_state=lambda state: self.fire("on_recovery_state", state),
                                 restore_source=lambda: self.restore_source)
        # In-memory snapshots on peers (recovery.snapshot_every); they need the checkpointing pool.
        self.snapshots = (SnapshotKeeper(cfg.recovery, emit=self.run_dir.event, run_key=self.run_dir.key)
                          if cfg.recovery.snapshot_every != 0 and self.checkpoints_on else None)
        self.restore_source: str | None = None  # where the last restore came from (the recovered event)
        # The controller's part of a checkpoint: one line per stateful part.
        self.state = ControllerState()
        self.state.register("step", Attribute(self, "step", int))
        self.state.register("loader", self.loader)
        self.state.register("kl_ctrl", self.kl_ctrl)
        self.state.register("failure_budget", self.recovery.policy, optional=True)  # older checkpoints: none
        self.initial_state = self.state.state_dict()  # what a run with no valid checkpoint restarts from

    def fire(self, name: str, *args) -> None:
        """Call ``name(trainer, *args)`` on every hook that has it (fault injectors, probes)."""
        for hook in self.hooks:
            fn = getattr(hook, name, None)
            if fn is not None:
                fn(self, *args)

    def _on_event(self, kind: str, fields: dict) -> None:
        """Fault hooks hear of a save as it starts (to fail it mid-write)."""
        if kind == "checkpoint_started":
            self.fire("on_checkpoint_started", fields["step"])

    # ------------------------------------------------------------------ roles
    @property
    def checkpoints_on(self) -> bool:
        """Whether this run's pool saves checkpoints (and so holds the run's lease)."""
        return self._roles_factory.writes_checkpoints

    def start_roles(self) -> WorkerPool:
        if self.roles is None:
            if self.telemetry is not None:
                self.telemetry.start()
            if self.checkpoints_on:
                self.ckpt.acquire_lease()  # before any worker starts: a second controller is refused at once
            self.roles = self._roles_factory(self.cfg, self.tokenizer)
            # Whatever the run, node memory left by owners that are gone (a killed controller's
            # snapshots, a rank's reduction segment) is removed on every node.
            sweep_every_node(self.cfg.recovery.snapshot_node_dir,
                             self.snapshots.node_dir if self.snapshots is not None else None, SHM_DIR)
            if self.checkpoints_on:  # resume=off too: it sets the run's older steps aside
                self.restore(self.cfg.checkpoint.resume)
            if self.telemetry is not None:
                self.telemetry.watch_roles(self.roles, self.ckpt.last_committed_at())
        return self.roles

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The controller's part of a checkpoint (JSON): every registered part and the config digest."""
        return {**self.state.state_dict(), "config_digest": self.digest}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)
        if state.get("config_digest") not in (None, self.digest):
            logger.warning("resuming a checkpoint written with a different config (digest %s, now %s)",
                           state.get("config_digest"), self.digest)

    def restore(self, resume: str = "auto") -> int | None:
        """Load the checkpoint named by ``resume`` into the roles and the controller; returns its step."""
        state = self.ckpt.restore(self.roles, resume)
        if state is None:
            return None
        try:
            self.load_state_dict(state)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # checksummed, so crafted
            raise CheckpointCorruptError(f"trainer_state.json of step {state.get('step')}: malformed "
                                         f"controller state ({exc!r})") from exc
        self.restore_source = "checkpoint"
        return self._rolled_back()

    def _rolled_back(self) -> int:
        """After roles and controller state were restored: the rollout gets the weights, the
        metrics after the step are dropped, and so are the snapshots of the abandoned steps."""
        self.roles.sync_weights(self.step)
        self.run_dir.truncate_metrics_after(self.step)
        self.history = deque(self.run_dir.read_metrics(last=HISTORY_WINDOW), maxlen=HISTORY_WINDOW)
        if self.snapshots is not None:
            self.snapshots.drop_after(self.step)
        return self.step

    def restore_snapshot(self) -> int | None:
        """Roll back to the newest complete in-memory snapshot not older than the last committed
        checkpoint; None when there is none (the models are then rebuilt for a storage restore)."""
        if self.snapshots is None:
            return None
        self.ckpt.fence()
        snap = self.snapshots.restore(self.roles, self.ckpt.last_committed)
        if snap is None:
            if self.snapshots.partial:  # some ranks hold part of a snapshot: back to fresh models
                self.roles.init_models()
            return None
        self.load_state_dict(snap.trainer_state)
        self.ckpt.cleanup()  # what an abandoned save left half-written
        self.restore_source = "snapshot"
        return self._rolled_back()

    def restore_after_failure(self) -> int:
        """Roll roles and controller back to the newest complete snapshot, else the newest valid
        checkpoint, else the start; returns its step."""
        step = self.restore_snapshot()
        if step is not None:
            return step
        step = self.restore("auto")
        if step is None:
            self.restore_source = "start"
            # Back to the initial weights: the groups a recovery did not rebuild kept theirs.
            self.roles.init_models()
            if self.snapshots is not None:
                self.snapshots.drop_after(0)
            self.state.load_state_dict(self.initial_state)  # the failure budget is never refilled
            self.roles.sync_weights(0)
            self.run_dir.truncate_metrics_after(0)
            self.history.clear()
            step = 0
        return step

    def maybe_checkpoint(self) -> None:
        """Save when due (async: the step waits only for staging); commit finished saves."""
        if not self.checkpoints_on:
            return
        if self.ckpt.due(self.step):
            self.ckpt.save(self.roles, self.step, self.state_dict(), self.digest,
                           known_good=self.nonfinite.take_known_good())
        else:
            self.ckpt.poll(self.roles)

    def maybe_snapshot(self) -> None:
        """Start the in-memory snapshot of this step when due (not waited for)."""
        if self.snapshots is not None:
            self.snapshots.size(self.roles)  # recovery.snapshot_every=auto: once, after the first step
        if self.snapshots is not None and self.snapshots.due(self.step):
            self.snapshots.take(self.roles, self.step, self.state_dict())
            self.fire("on_snapshot_started", self.step)

    def shutdown(self) -> None:
        # Never started (e.g. refused by the run's lease): stopping would delete the live
        # controller's Prometheus targets file in the shared run folder.
        if self.telemetry is not None and self.telemetry.server.running:
            self.telemetry.stop()
        if self.roles is not None:
            self.roles.shutdown()
            self.roles = None
        if self.snapshots is not None:
            self.snapshots.close()
        self.ckpt.release_lease()

    # ------------------------------------------------------------------ loop
    def train_step(self) -> dict:
        """Run the next step and record it; returns its metrics row."""
        step = self.step + 1
        if self.checkpoints_on and self.ckpt.pending is not None:
            self.ckpt.poll(self.roles)  # commit a save that finished writing before this step starts
        self.fire("on_step_start", step)
        batch = self.loader.next_batch()
        t0 = time.perf_counter()
        metrics, phases = run_step(self.roles, batch, step, self.cfg, self.task, self.tokenizer, self.kl_ctrl,
                                   version=self.step)
        duration = time.perf_counter() - t0
        self.ckpt.fence()  # a controller whose run was taken over while it hung stops here, logging nothing
        self.step = step
        row = {"step": step, **metrics, "timing/step_s": duration,
               **{f"timing/{p}_s": phases[p] for p in PHASES if p in phases},
               "perf/tokens_per_s": metrics["tokens"] / duration if duration > 0 else 0.0}
        self.run_dir.append_metrics(row)
        self.history.append(row)
        if self.telemetry is not None:
            self.telemetry.observe_step(row)
        if self.trackers is not None:
            self.trackers.log_metrics(step, row)
        return row

    def fit(self) -> list[dict]:
        """Train to ``total_steps``; returns the newest rows of the metric history (at most
        :data:`HISTORY_WINDOW`; the whole history is ``self.run_dir.read_metrics()``).

        ``controller.json`` in the run folder names this process while it runs and says how it ended.
        The whole log goes to ``train.log`` in the run folder; metrics and events go to the
        trackers of ``trainer.loggers`` (the console gets a summary every ``trainer.log_every`` steps).
        """
        from tqdm import tqdm

        with RunLog(self.run_dir.path / "train.log"):
            self.trackers = build_trackers(self.cfg, self.run_dir)
            try:
                with controller_session(self.run_dir.path, lambda: self.step) as record:
                    self.start_roles()
                    record.start_step = self.step
                    record.write(self.run_dir.path)
                    return self._fit_loop(tqdm)
            finally:
                self.trackers.close()
                self.trackers = None

    def _fit_loop(self, tqdm) -> list[dict]:
        total = self.cfg.trainer.total_steps
        bar = tqdm(total=total, initial=self.step, disable=not self.cfg.trainer.progress_bar, unit="step",
                   dynamic_ncols=True)
        try:
            while self.step < total:
                try:
                    row = self.train_step()
                    if not self.nonfinite.after_step(row):  # rolled back past a NaN/Inf
                        bar.n = self.step
                        bar.refresh()
                        continue
                    self.maybe_checkpoint()
                    self.maybe_snapshot()
                    if self.step >= total and self.checkpoints_on:
                        # The last save, waited for (bounded) inside the recovery: a rank that lost
                        # it rolls the run back to the last commit and the final steps are replayed.
                        self.ckpt.finish(self.roles)
                except WorkerError as exc:
                    self.recovery.handle(exc, self.step + 1)
                    bar.n = self.step
                    bar.refresh()
                    continue
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", step_s=f"{row['timing/step_s']:.2f}")
        finally:
            bar.close()
        return list(self.history)
