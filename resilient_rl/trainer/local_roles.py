"""Role backend that runs every engine in the calling process (no Ray, no process group).

It is the single-process baseline the benchmarks compare the Ray trainer against, and the
reference a distributed step is tested against.
"""

from __future__ import annotations

import time

from resilient_rl.protocol import DataProto
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.rollout import RolloutEngine
from resilient_rl.workers.value import ValueEngine
from resilient_rl.workers.weight_sync import write_into


class LocalRoles:
    """Actor, critic, ref and rollout engines in this process."""

    #: This backend saves no checkpoints, so the trainer takes no lease on the run for it.
    writes_checkpoints = False

    def __init__(self, cfg, tokenizer):
        plan = plan_device(cfg.trainer.device)
        vocab, seed, steps = tokenizer.vocab_size, cfg.trainer.seed, cfg.trainer.total_steps
        self.actor = PolicyEngine(cfg.model, vocab, seed, plan, actor_cfg=cfg.actor, total_steps=steps)
        self.ref = PolicyEngine(cfg.model, vocab, seed, plan, trainable=False)
        self.rollout = RolloutEngine(cfg.model, cfg.rollout, vocab, seed, plan, tokenizer.eos_token_id,
                                     tokenizer.pad_token_id)
        self.critic_enabled = cfg.critic.enabled
        self.critic = ValueEngine(cfg.model, cfg.critic, vocab, seed + 1, plan, total_steps=steps) \
            if self.critic_enabled else None

    def generate(self, prompts: DataProto) -> DataProto:
        return self.rollout.generate_sequences(prompts, rank=0)

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ref_log_prob": self.ref.compute_log_prob(data).batch["log_probs"]})

    def compute_log_prob(self, data: DataProto) -> DataProto:
        out = self.actor.compute_log_prob(data)
        return DataProto.from_dict({"old_log_probs": out.batch["log_probs"], "entropys": out.batch["entropys"]})

    def compute_values(self, data: DataProto) -> DataProto:
        return self.critic.compute_values(data)

    def update_critic(self, data: DataProto) -> list[dict]:
        return [self.critic.update(data, int(data.meta_info["step"]))]

    def update_actor(self, data: DataProto) -> list[dict]:
        return [self.actor.update(data, int(data.meta_info["step"]))]

    def sync_weights(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        nbytes = write_into(self.actor.model, dict(self.rollout.model.named_parameters()))
        self.rollout.version = int(version)
        return {"perf/weight_sync_bytes": float(nbytes), "perf/weight_sync_worker_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        pass
