"""GRPO steps through the trainer's step function with the static rollout engine, in one process
(no Ray): the engine is what runs, the step trains, and a replayed generation samples the same tokens."""

from __future__ import annotations

import numpy as np
import torch

from resilient_rl.config.schema import load_config
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.trainer.step import make_prompts, run_step

SMALL = ["trainer.total_steps=2", "trainer.progress_bar=false", "data.batch_size=4", "actor.mini_batch_size=8",
         "actor.ppo_epochs=1", "data.num_prompts=16", "algorithm.adv_estimator=grpo", "rollout.n=4",
         "rollout.max_new_tokens=6", "rollout.finish_check_every=2", "rollout.compact_min_fraction=0"]


def two_steps(tmp_path, name: str, engine: str):
    cfg = load_config(None, SMALL + [f"trainer.output_dir={tmp_path}", f"checkpoint.root={tmp_path}/ckpt",
                                     f"trainer.run_name={name}", f"rollout.engine={engine}"])
    trainer = PPOTrainer(cfg)
    roles = LocalRoles(cfg, trainer.tokenizer)
    rows = []
    for step in (1, 2):
        metrics, _ = run_step(roles, trainer.loader.next_batch(), step, cfg, trainer.task, trainer.tokenizer,
                              trainer.kl_ctrl, version=step - 1)
        rows.append(metrics)
    return rows, roles, trainer


def test_grpo_trains_with_the_static_engine_and_replays_bit_for_bit(tmp_path):
    rows, roles, trainer = two_steps(tmp_path, "static", "static")
    assert roles.rollout.engine == "static"
    assert all(np.isfinite(r["actor/pg_loss"]) for r in rows)
    assert 0 < rows[0]["response_length/mean"] <= 6
    again, _, _ = two_steps(tmp_path, "static-again", "static")

    def untimed(rs):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rs]

    assert untimed(again) == untimed(rows)  # same seed, same run: every metric bit for bit

    # A generation replayed after a failure (same seed, step, rank and weights) samples the same tokens.
    batch = trainer.loader.next_batch()
    meta = {"seed": trainer.cfg.trainer.seed, "step": 3, "weights_version": 2}
    first = roles.generate(make_prompts(batch, 4, meta))
    replay = roles.generate(make_prompts(batch, 4, meta))
    assert all(torch.equal(first.batch[k], replay.batch[k]) for k in first.batch.keys())
    other = roles.generate(make_prompts(batch, 4, {**meta, "step": 4}))
    assert not torch.equal(first.batch["responses"], other.batch["responses"])

