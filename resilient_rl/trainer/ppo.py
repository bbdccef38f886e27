"""The PPO/GRPO fit loop driven by the single controller.

The controller owns the data loader, the KL controller, the step counter and the run folder;
the roles (Ray worker groups, or local engines for the single-process baseline) own the models.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from resilient_rl.algos.kl import get_kl_controller
from resilient_rl.trainer.data import PromptDataset, StatefulPromptLoader
from resilient_rl.trainer.run_dir import RunDir
from resilient_rl.trainer.step import PHASES, run_step
from resilient_rl.trainer.tasks import get_task
from resilient_rl.trainer.tokenizer import DEFAULT_ALPHABET, CharTokenizer

logger = logging.getLogger(__name__)


def reward_summary(rows: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and of the last 10% of steps (at least one step each)."""
    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 10)
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))


class PPOTrainer:
    """Runs ``cfg.trainer.total_steps`` steps of PPO (GAE) or GRPO."""

    def __init__(self, cfg, roles_factory: Callable | None = None):
        self.cfg = cfg
        self.task = get_task(cfg.data)
        self.tokenizer = CharTokenizer(getattr(self.task, "alphabet", DEFAULT_ALPHABET))
        self.dataset = PromptDataset.from_config(cfg.data, self.tokenizer)
        self.dataset.check_fits(cfg.model.max_seq_len, cfg.rollout.max_new_tokens)
        self.loader = StatefulPromptLoader.from_config(self.dataset, cfg.data)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.step = 0
        self.run_dir = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
        self.run_dir.save_config(cfg)
        self._roles_factory = roles_factory
        self.roles = None
        self.history: list[dict] = []

    # ------------------------------------------------------------------ roles
    def start_roles(self):
        if self.roles is None:
            if self._roles_factory is None:
                from resilient_rl.trainer.ray_roles import RayRoles

                self._roles_factory = RayRoles
            self.roles = self._roles_factory(self.cfg, self.tokenizer)
        return self.roles

    def shutdown(self) -> None:
        if self.roles is not None:
            self.roles.shutdown()
            self.roles = None

    # ------------------------------------------------------------------ loop
    def train_step(self) -> dict:
        """Run the next step and record it; returns its metrics row."""
        step = self.step + 1
        batch = self.loader.next_batch()
        t0 = time.perf_counter()
        metrics, phases = run_step(self.roles, batch, step, self.cfg, self.task, self.tokenizer, self.kl_ctrl,
                                   version=self.step)
        duration = time.perf_counter() - t0
        self.step = step
        row = {"step": step, **metrics, "timing/step_s": duration,
               **{f"timing/{p}_s": phases[p] for p in PHASES if p in phases},
               "perf/tokens_per_s": metrics["tokens"] / duration if duration > 0 else 0.0}
        self.run_dir.append_metrics(row)
        self.history.append(row)
        return row

    def fit(self) -> list[dict]:
        """Train to ``total_steps``; returns the metric history of this run."""
        from tqdm import tqdm

        self.start_roles()
        total = self.cfg.trainer.total_steps
        bar = tqdm(total=total, initial=self.step, disable=not self.cfg.trainer.progress_bar, unit="step",
                   dynamic_ncols=True)
        try:
            while self.step < total:
                row = self.train_step()
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", step_s=f"{row['timing/step_s']:.2f}")
                if self.cfg.trainer.log_every and row["step"] % self.cfg.trainer.log_every == 0:
                    logger.info("step %d %s", row["step"], " ".join(
                        f"{k}={v:.4g}" for k, v in row.items() if k != "step" and not k.startswith("timing/")))
        finally:
            bar.close()
        return self.history
