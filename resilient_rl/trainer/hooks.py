"""The trainer's hooks: points of a run where fault injectors, probes and benchmarks act.

A hook subclasses :class:`TrainerHook` and overrides the points it acts on; the others do
nothing. Each is called in the controller's thread with the trainer, so a fault injector can
reach the pool it kills processes of, and a probe can read the run's state. The trainer refuses
a hook that is not a TrainerHook, at construction: a misspelt method would otherwise never run.
"""

from __future__ import annotations

from typing import Any

from resilient_rl.recovery.states import RecoveryState

#: The :class:`~resilient_rl.trainer.ppo.PPOTrainer` calling the hook (which imports this module).
Trainer = Any


class TrainerHook:
    """Base of every hook of :class:`~resilient_rl.trainer.ppo.PPOTrainer`."""

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        """Step ``step`` is about to run (also when it is replayed after a recovery)."""

    def on_validation_start(self, trainer: Trainer, step: int) -> None:
        """A validation pass over the weights of step ``step`` is about to run (0: before training)."""

    def on_weight_sync_start(self, trainer: Trainer, step: int) -> None:
        """Step ``step``'s updates are done and the rollout is about to get their weights."""

    def on_checkpoint_started(self, trainer: Trainer, step: int) -> None:
        """The save of step ``step`` has started: its shards are being written."""

    def on_snapshot_started(self, trainer: Trainer, step: int) -> None:
        """The in-memory snapshot of step ``step`` has started (ranks copying, peers fetching)."""

    def on_final_save_wait(self, trainer: Trainer, step: int) -> None:
        """The last step ``step`` is done and the run is about to wait for its save to commit."""

    def on_recovery_state(self, trainer: Trainer, state: RecoveryState) -> None:
        """A recovery entered ``state`` (recovering, rejoining, restoring or aborting)."""


def check_hooks(hooks: list) -> list[TrainerHook]:
    """``hooks``, each checked to be a :class:`TrainerHook`."""
    for hook in hooks:
        if not isinstance(hook, TrainerHook):
            raise TypeError(f"trainer hook {hook!r} is not a resilient_rl.trainer.hooks.TrainerHook: subclass it "
                            "and override the points it acts on")
    return list(hooks)
