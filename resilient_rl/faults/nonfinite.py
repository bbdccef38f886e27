"""Fault injectors that put NaN or Inf into a run, as trainer hooks.

    trainer = PPOTrainer(cfg, hooks=[NonFiniteReward(steps=[2]), NonFiniteAdvantage(steps=[4])])

- :class:`NonFiniteReward`: the task's reward returns NaN (or another value) for the responses
  of the given steps, as a user's reward function might.
- :class:`NonFiniteAdvantage`: the advantage of one sample of the given steps becomes NaN just
  before the actor's update, so its loss and the global gradient norm are NaN on the workers (on
  a sharded actor only the rank that holds the sample sees it locally).

Each fires once per listed step, the first time that step starts (a step replayed after a
rollback or a recovery is not poisoned again), and records where it fired in ``fired``.
"""

from __future__ import annotations

import math
from typing import Iterable
from resilient_rl.trainer.hooks import TrainerHook


class _PoisonedTask:
    """A task whose reward is replaced by ``value`` while ``active``; everything else delegates."""

    def __init__(self, inner, value: float):
        self.inner, self.value, self.active = inner, value, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reward(self, response: str, answer: str) -> float:
        return self.value if self.active else self.inner.reward(response, answer)


class NonFiniteReward(TrainerHook):
    """Make every reward of steps ``steps`` equal ``value`` (NaN by default)."""

    def __init__(self, steps: Iterable[int], value: float = math.nan):
        self.steps = set(int(s) for s in steps)
        self.value = float(value)
        self.fired: list[int] = []

    def on_step_start(self, trainer, step: int) -> None:
        if not isinstance(trainer.task, _PoisonedTask):
            trainer.task = _PoisonedTask(trainer.task, self.value)
        trainer.task.active = step in self.steps and step not in self.fired
        if trainer.task.active:
            self.fired.append(step)


class NonFiniteAdvantage(TrainerHook):
    """Set the advantage of sample ``index`` to ``value`` (NaN) in the actor update of ``steps``."""

    def __init__(self, steps: Iterable[int], index: int = 0, value: float = math.nan):
        self.steps = set(int(s) for s in steps)
        self.index, self.value = int(index), float(value)
        self.fired: list[int] = []

    def on_step_start(self, trainer, step: int) -> None:
        if step not in self.steps or step in self.fired:
            return
        self.fired.append(step)
        roles = trainer.roles
        original = roles.concurrently

        def poisoned(calls):
            # The step's updates go out together: poison the actor's, once (the pool's own method
            # answers every later call). The critic's update reads no advantages.
            if any(method == "update_actor" for method, _ in calls):
                del roles.concurrently
                for method, data in calls:
                    if method == "update_actor":
                        data.batch["advantages"][self.index] = self.value
            return original(calls)

        roles.concurrently = poisoned


def nonfinite_tensors(root: str, run_name: str, storage_options: dict | None = None) -> list[str]:
    """``step/file:tensor`` of every non-finite tensor in the committed checkpoints of a run
    (an empty list is what a run must leave behind)."""
    from safetensors.torch import load as load_safetensors

    from resilient_rl.checkpoint import CheckpointManager, Storage, step_dirname

    manager = CheckpointManager(root, run_name, storage_options=storage_options)
    bad = []
    for step in manager.committed_steps():
        for rec in manager.load_manifest(step).files:
            if not rec.path.endswith(".safetensors"):
                continue
            data = manager.storage.read_bytes(Storage.join(run_name, step_dirname(step), rec.path))
            for name, t in load_safetensors(data).items():
                if (t.is_floating_point() or t.is_complex()) and not bool(t.isfinite().all()):
                    bad.append(f"{step}/{rec.path}:{name}")
    return bad
