"""The PPO/GRPO trainer driven by the single controller: its parts, its state and its step.

The controller owns the data loader, the KL controller, the step counter and the run folder;
the roles (Ray worker groups, or local engines for the single-process baseline) own the models.
:class:`PPOTrainer` wires the parts together (checkpoints, snapshots, the NaN guard, the
roll-back and the recovery, telemetry, hooks), holds the controller's state and when it is saved,
and runs and records one step (:func:`~resilient_rl.trainer.step.run_step`). The rest is in
modules of their own, each called with the trainer: the run's start and end (claim, roles,
resume, shutdown) in :mod:`.lifecycle`, the fit loop and its handling of failures in
:mod:`.fit_loop`, a preemption and a lost cluster in :mod:`.preemption`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable


from resilient_rl.algos.kl import get_kl_controller
from resilient_rl.events.kinds import (CheckpointCommitted, CheckpointRefused, CheckpointStarted,
                                       RecoveryStateEntered)
from resilient_rl.models.factory import model_vocab_size
from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
from resilient_rl.checkpoint.controller_state import Attribute, ControllerState
from resilient_rl.models.hf_folder import check_max_seq_len, model_eos_token_ids
from resilient_rl.runtime.pool import WorkerPool
from resilient_rl.config.schema import config_digest
from resilient_rl.run.record import ControllerRecord
from resilient_rl.data.loader import PromptDataset, StatefulPromptLoader
from resilient_rl.recovery.nonfinite import NonFiniteGuard
from resilient_rl.recovery.driver import Recovery
from resilient_rl.recovery.policy import FailurePolicy
from resilient_rl.recovery.states import RecoveryState
from resilient_rl.recovery.rollback import AFTER_NONFINITE, KEPT_AFTER_NONFINITE, RollBack
from resilient_rl.workers.snapshots.carry import RECORD
from resilient_rl.checkpoint.leases.run_claim import RunClaim
from resilient_rl.run.folder import RunDir
from resilient_rl.workers.snapshots.keeper import SnapshotKeeper
from resilient_rl.trainer.hooks import check_hooks
from resilient_rl.trainer import fit_loop, lifecycle
from resilient_rl.trainer.preemption import Preemption
from resilient_rl.trainer.resume_check import CONFIG_KEY, checkpoint_config, named_file_digests
from resilient_rl.workers.snapshots.node_sweep import NodeSweeps
from resilient_rl.workers.shm_reduce import SHM_DIR
from resilient_rl.trainer.step import DECODE_EAGER_REASON, PHASES, run_step
from resilient_rl.data.held_out import held_out_dataset
from resilient_rl.data.tasks import get_task
from resilient_rl.trainer.validation import Validator
from resilient_rl.telemetry.hook import TelemetryHook
from resilient_rl.data.tokenizer import build_tokenizer
from resilient_rl.telemetry.trackers import check_available

logger = logging.getLogger(__name__)

#: Rows of the metric history kept in memory (``PPOTrainer.history``); the whole history is in
#: the run folder's ``metrics.jsonl``, so a week-long run does not grow the controller.
HISTORY_WINDOW = 1000


def resolve_total_epochs(cfg, num_prompts: int) -> None:
    """verl's ``trainer.total_epochs``: set ``trainer.total_steps`` to that many epochs of
    ``num_prompts // data.batch_size`` steps (the loader drops an epoch's last incomplete batch,
    as verl's does); the number of prompts is known only once the data is read."""
    epochs = cfg.trainer.total_epochs
    if epochs is None:
        return
    per_epoch = num_prompts // cfg.data.batch_size
    steps = epochs * per_epoch
    if steps != cfg.trainer.total_steps:
        logger.info("trainer.total_epochs=%d: trainer.total_steps=%d (%d prompts // data.batch_size=%d = %d per epoch)",
                    epochs, steps, num_prompts, cfg.data.batch_size, per_epoch)
    cfg.trainer.total_steps = steps


class PPOTrainer:
    """Runs ``cfg.trainer.total_steps`` steps of PPO (GAE) or GRPO."""

    def __init__(self, cfg, roles_factory: Callable | None = None, hooks: list | None = None):
        self.cfg = cfg
        self._decode_eager_reported = False
        file_digests = named_file_digests(cfg)  # what the files held before they are read below
        self.task = get_task(cfg.data, cfg.custom_reward_function)
        self.tokenizer = build_tokenizer(cfg.data, self.task)
        model_vocab_size(cfg.model, self.tokenizer.vocab_size)  # fail here, not in a worker, if too small
        check_max_seq_len(cfg.model)
        extra_eos = model_eos_token_ids(cfg.model)
        if extra_eos and hasattr(self.tokenizer, "add_eos_token_ids"):
            self.tokenizer.add_eos_token_ids(extra_eos)
        self.dataset = PromptDataset.from_config(cfg.data, self.tokenizer, self.task)
        self.dataset.check_fits(cfg.model.max_seq_len, cfg.rollout.max_new_tokens)
        self.loader = StatefulPromptLoader.from_config(self.dataset, cfg.data)
        # The held-out prompts are read and checked here too, before any worker starts.
        held_out = held_out_dataset(cfg.data, self.tokenizer, self.task, self.dataset)
        if held_out is not None:
            held_out.check_fits(cfg.model.max_seq_len, cfg.rollout.max_new_tokens)
        self.validator = Validator(cfg, held_out, self.task, self.tokenizer)
        resolve_total_epochs(cfg, len(self.dataset))  # before the config is digested or sent to workers
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.step = 0
        check_available(cfg.trainer.loggers)
        self.run_dir = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
        self.digest = config_digest(cfg)
        self._checkpoint_config = checkpoint_config(cfg, file_digests)
        self.hooks = check_hooks(list(hooks or []))
        if roles_factory is None:
            from resilient_rl.runtime.pool.ray_roles import RayRoles
            from resilient_rl.workers.memory_plan import announce
            from resilient_rl.workers.roles import ROLE_CLASSES

            roles_factory = RayRoles.running(ROLE_CLASSES, announce)
        self._roles_factory = roles_factory
        self.roles: WorkerPool | None = None
        self.history: deque[dict] = deque(maxlen=HISTORY_WINDOW)  # the newest rows
        self.trackers = None  # the trainer.loggers backends, open while fit() runs
        self.controller_record: ControllerRecord | None = None  # controller.json, while fit() runs
        self.telemetry = (TelemetryHook(cfg, self.run_dir, self.run_dir.subscribe) if cfg.telemetry.enabled
                          else None)
        self.ckpt = CheckpointCoordinator(cfg, on_event=self.run_dir.event, metrics=self.telemetry)
        self.claim_ = RunClaim(cfg, self.run_dir.path, self.ckpt)
        self._claimed = False
        # Set by SIGTERM/SIGUSR1 once the CLI installs its handlers: the loop stops at its next safe point.
        self.preemption = Preemption()
        self.nonfinite = NonFiniteGuard(cfg.trainer, emit=self.run_dir.event, can_roll_back=self.checkpoints_on,
                                        last_committed=lambda: self.ckpt.last_committed)
        self.run_dir.subscribe(self.nonfinite.on_checkpoint_event, CheckpointRefused, CheckpointCommitted)
        self.run_dir.subscribe(self._on_checkpoint_started, CheckpointStarted)
        self.run_dir.subscribe(self._on_recovery_state, RecoveryStateEntered)
        # In-memory snapshots on peers (recovery.snapshot_every); they need the checkpointing pool.
        self.snapshots = (SnapshotKeeper(cfg.recovery, emit=self.run_dir.event, run_key=self.run_dir.key,
                                         record_path=str(self.run_dir.path / RECORD))
                          if cfg.recovery.snapshot_every != 0 and self.checkpoints_on else None)
        # Sweeps of every node's memory: at the start of the workers, then every minute of the run.
        self.node_sweeps = NodeSweeps(cfg.recovery.snapshot_node_dir,
                                      self.snapshots.node_dir if self.snapshots is not None else None, SHM_DIR)
        # The controller's part of a checkpoint: one line per stateful part.
        policy = FailurePolicy.from_config(cfg.recovery)
        self.state = ControllerState()
        self.state.register("step", Attribute(self, "step", int))
        self.state.register("loader", self.loader)
        self.state.register("kl_ctrl", self.kl_ctrl)
        self.state.register("failure_budget", policy, optional=True)  # older checkpoints: none
        # A replayed step counts its NaN once; older checkpoints have none (the counters stay).
        self.state.register("nonfinite", self.nonfinite, optional=True)
        # Rolling back (resume, recovery, NaN) and recovering; what the state holds now is the start.
        self.rollback = RollBack(self.ckpt, self.snapshots, self.state, self.run_dir, self.history, self.digest)
        self.recovery = Recovery(cfg.recovery, checkpoints=self.ckpt, rollback=self.rollback, emit=self.run_dir.event,
                                 policy=policy)

    def _on_recovery_state(self, event: RecoveryStateEntered) -> None:
        """Fault hooks hear of each state a recovery enters (to fail what it is doing)."""
        state = RecoveryState(event.state)
        for hook in self.hooks:
            hook.on_recovery_state(self, state)

    def _on_checkpoint_started(self, event: CheckpointStarted) -> None:
        """Fault hooks hear of a save as it starts (to fail it mid-write)."""
        for hook in self.hooks:
            hook.on_checkpoint_started(self, event.step)

    # ------------------------------------------------------------------ the run's start and end
    @property
    def checkpoints_on(self) -> bool:
        """Whether this run's pool saves checkpoints (and so holds the run's lease)."""
        return self._roles_factory.writes_checkpoints

    def claim(self) -> None:
        """Check the config against the checkpoint to resume, take the run's leases, write the
        config: before anything else is written (idempotent; :func:`.lifecycle.claim`)."""
        lifecycle.claim(self)

    def start_roles(self) -> WorkerPool:
        """Start the roles once, claiming the run first, and resume (:func:`.lifecycle.start_roles`)."""
        return lifecycle.start_roles(self)

    def shutdown(self) -> None:
        """Stop the telemetry and the roles and release the run (:func:`.lifecycle.shutdown`)."""
        lifecycle.shutdown(self)

    # ------------------------------------------------------------------ the state, and when it is saved
    def state_dict(self) -> dict:
        """The controller's part of a checkpoint (JSON): every registered part and the config digest."""
        return {**self.state.state_dict(), "config_digest": self.digest}

    def load_state_dict(self, state: dict) -> None:
        """Take over the controller's part of a checkpoint (see :meth:`state_dict`)."""
        self.rollback.load_controller_state(state)

    def roll_back_nonfinite(self, failed_step: int, what: str) -> None:
        """After a NaN or Inf in ``failed_step``: the newest known-good checkpoint (or the start),
        keeping the data position, so the next step trains on the batch after the poisoned one."""
        self.ckpt.wait(self.roles)  # a save in flight commits first (or is refused if not finite)
        self.rollback.roll_back_to(self.roles, *AFTER_NONFINITE, keep=KEPT_AFTER_NONFINITE)
        self.nonfinite.rolled_back(failed_step, self.step, what)

    def maybe_checkpoint(self) -> None:
        """Save when due (async: the step waits only for staging); commit finished saves."""
        if not self.checkpoints_on:
            return
        if self.ckpt.due(self.step):
            self.save_checkpoint()
        else:
            self.ckpt.poll(self.roles)

    def save_checkpoint(self) -> None:
        """Start the save of the current step (async: the step waits only for staging)."""
        # First the verdict, so the NaN guard's state saved says this save is in flight (restored,
        # it has committed). The config goes with the checkpoint: a resume compares its own with it.
        known_good = self.nonfinite.take_known_good(self.step)
        state = {**self.state_dict(), CONFIG_KEY: self._checkpoint_config}
        self.ckpt.save(self.roles, self.step, state, self.digest, known_good=known_good)

    def maybe_snapshot(self) -> None:
        """Start the in-memory snapshot of this step when due (not waited for)."""
        if self.snapshots is not None:
            self.snapshots.size(self.roles)  # recovery.snapshot_every=auto: once, after the first step
        if self.snapshots is not None and self.snapshots.due(self.step):
            self.snapshots.take(self.roles, self.step, self.state_dict())
            for hook in self.hooks:
                hook.on_snapshot_started(self, self.step)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict:
        """Run the next step and record it; returns its metrics row."""
        step = self.step + 1
        if self.checkpoints_on and self.ckpt.pending is not None:
            self.ckpt.poll(self.roles)  # commit a save that finished writing before this step starts
        for hook in self.hooks:
            hook.on_step_start(self, step)
        batch = self.loader.next_batch()
        t0 = time.perf_counter()
        metrics, phases = run_step(self.roles, batch, step, self.cfg, self.task, self.tokenizer, self.kl_ctrl,
                                   version=self.step, before_sync=lambda: self._weight_sync_starts(step))
        duration = time.perf_counter() - t0
        eager_reason = metrics.pop(DECODE_EAGER_REASON, None)
        # Not part of the step's time or throughput; a failure here fails (and replays) the step.
        val = self.validate(step) if self.validator.due(step) else {}
        self._fence()
        self.step = step
        row = {"step": step, **metrics, "timing/step_s": duration,
               **{f"timing/{p}_s": phases[p] for p in PHASES if p in phases},
               "perf/tokens_per_s": metrics["tokens"] / duration if duration > 0 else 0.0, **val}
        if eager_reason is not None and not self._decode_eager_reported:
            self._decode_eager_reported = True
            self.run_dir.event("decode_eager", step=step, reason=str(eager_reason))
        return self._record(row, self.telemetry and self.telemetry.observe_step)

    def _weight_sync_starts(self, step: int) -> None:
        """Fault hooks hear of a weight sync as it starts (to fail a rank inside it)."""
        for hook in self.hooks:
            hook.on_weight_sync_start(self, step)

    def _fence(self) -> None:
        """Before a row is recorded: a controller whose run was taken over while it hung stops
        here, logging nothing."""
        self.ckpt.fence()
        self.claim_.raise_if_lost()

    def _record(self, row: dict, observe) -> dict:
        """Append ``row`` to the metrics file and the history, export it (``observe``, the
        telemetry's method for it; None without telemetry) and log it to the trackers."""
        self.run_dir.append_metrics(row)
        self.history.append(row)
        if observe is not None:
            observe(row)
        if self.trackers is not None:
            self.trackers.log_metrics(row["step"], row)
        return row

    def validate(self, step: int) -> dict:
        """A validation pass over the rollout's weights of ``step``: its ``val/`` metrics."""
        for hook in self.hooks:
            hook.on_validation_start(self, step)
        return self.validator.run(self.roles, step)

    def validate_before_train(self) -> dict:
        """``trainer.val_before_train``: validate the initial weights and record the ``step: 0`` row."""
        row = {"step": 0, **self.validate(0)}
        self._fence()
        return self._record(row, self.telemetry and self.telemetry.observe_validation)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict]:
        """Train to ``total_steps``; returns the newest rows of the metric history (at most
        :data:`HISTORY_WINDOW`; the whole history is ``self.run_dir.read_metrics()``). The loop and
        its handling of failures: :mod:`.fit_loop`."""
        return fit_loop.fit(self)
