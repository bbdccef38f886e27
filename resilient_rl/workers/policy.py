"""The policy engine behind the actor and ref roles: log-probs and the PPO update.

It is plain PyTorch (no Ray), so the same code runs inside a Ray worker on an FSDP2 shard and in a
single process. The loss is normalised by the number of response tokens over the whole
data-parallel group, so a step on N ranks computes the same gradient as one process on the
concatenated batch (FSDP2 averages gradients over ranks, hence the ``world_size`` factor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from resilient_rl.algos.kl import kl_penalty
from resilient_rl.algos.losses import entropy_from_logits, logprobs_from_logits, ppo_policy_loss
from resilient_rl.runtime import progress
from resilient_rl.models.factory import build_causal_lm
from resilient_rl.protocol import DataProto
from resilient_rl.workers.fsdp import (DevicePlan, all_reduce_gradients, build_optimizer, build_scheduler,
                                       clip_grad_norm, global_token_counts, step_scheduler, update_is_finite,
                                       wrap_model)


def dp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def response_logits(model, data: DataProto, device: torch.device) -> torch.Tensor:
    """Logits predicting each response token: positions ``P-1 .. P+R-2`` of the full sequence."""
    b = data.batch
    resp_len = b["responses"].shape[1]
    out = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device),
                position_ids=b["position_ids"].to(device), use_cache=False)
    return out.logits[:, -resp_len - 1:-1, :].float()


class PolicyEngine:
    """A causal LM that scores responses and, when trainable, takes PPO steps."""

    def __init__(self, model_cfg, vocab_size: int, seed: int, plan: DevicePlan, actor_cfg=None,
                 total_steps: int = 1, trainable: bool = True, reshard_after_forward: bool = True,
                 empty: bool = False):
        """``empty``: the weights are allocated, not initialised, for a restore to fill (the
        caller must load the whole state before using the engine)."""
        self.plan = plan
        self.cfg = actor_cfg
        self.trainable = trainable
        model = build_causal_lm(model_cfg, vocab_size, seed, empty=empty)
        if not trainable:
            model.requires_grad_(False)
        # The ref (no actor config) follows ``auto``: a replica on CPU (its forward then runs no
        # FSDP hooks), FSDP2 shards on CUDA (less memory; once gathered, no collectives either).
        strategy = actor_cfg.strategy if actor_cfg is not None else "auto"
        self.model = wrap_model(model, plan, strategy, reshard_after_forward=reshard_after_forward)
        self.model.train(False)
        self.optimizer = build_optimizer(self.model, actor_cfg.optim) if trainable else None
        self.scheduler = build_scheduler(self.optimizer, actor_cfg.optim, total_steps) if trainable else None

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, micro_batch_size: int | None = None) -> DataProto:
        """Log-probs (and entropies) of the response tokens under the current weights."""
        parts = [data] if not micro_batch_size else data.split(micro_batch_size)
        logps, ents = [], []
        for part in parts:
            progress.advance("micro-batch")
            logits = response_logits(self.model, part, self.plan.device)
            logps.append(logprobs_from_logits(logits, part.batch["responses"].to(self.plan.device)).cpu())
            ents.append(entropy_from_logits(logits).cpu())
        return DataProto.from_dict({"log_probs": torch.cat(logps), "entropys": torch.cat(ents)})

    def update(self, data: DataProto, step: int) -> dict[str, float]:
        """PPO epochs over mini-batches of ``data`` (this rank's share); one scheduler step.

        A mini-batch whose loss or gradient norm is NaN or Inf (on any rank) is not applied: its
        gradients are dropped, the optimizer does not step, and ``actor/nonfinite_skipped``
        counts it (its losses stay out of the reported means)."""
        cfg = self.cfg
        world = dp_world_size()
        local_mb = max(1, cfg.mini_batch_size // world)
        self.model.train(True)
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs",
                "advantages"] + (["ref_log_prob"] if cfg.use_kl_loss else [])
        sums: dict[str, float] = {}
        n_updates = skipped = 0
        # Mini-batch order is a pure function of (seed, step): replays after recovery shuffle identically.
        seed = int(data.meta_info.get("seed", 0)) * 1_000_003 + step
        mini_batches = list(data.select(batch_keys=keys).make_iterator(local_mb, cfg.ppo_epochs, seed=seed))
        masks = [mb.batch["response_mask"].to(self.plan.device).float() for mb in mini_batches]
        counts = global_token_counts(masks).clamp(min=1.0)
        for mb, mask, (tokens, seqs) in zip(mini_batches, masks, counts):
            progress.advance("mini-batch")
            b = mb.batch
            logits = response_logits(self.model, mb, self.plan.device)
            logp = logprobs_from_logits(logits, b["responses"].to(self.plan.device))
            # A local mean times world * (local units / global units) is this rank's share of the
            # global mean (FSDP averages gradients over ranks): units are tokens for token means,
            # sequences with a valid token for the policy loss's sequence means.
            scale = world * mask.sum() / tokens
            pg = ppo_policy_loss(b["old_log_probs"].to(self.plan.device), logp, b["advantages"].to(self.plan.device),
                                 mask, clip_ratio=cfg.clip_ratio, loss_agg_mode=cfg.loss_agg_mode)
            loss = pg["pg_loss"]
            entropy = (entropy_from_logits(logits) * mask).sum() / mask.sum().clamp(min=1.0)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy
            if cfg.use_kl_loss:
                kl = kl_penalty(logp, b["ref_log_prob"].to(self.plan.device), cfg.kl_loss_type)
                kl_loss = (kl * mask).sum() / mask.sum().clamp(min=1.0)
                loss = loss + cfg.kl_loss_coef * kl_loss
            if cfg.loss_agg_mode == "token-mean":
                (loss * scale).backward()
            else:
                seq_scale = world * mask.bool().any(dim=-1).sum() / seqs
                (pg["pg_loss"] * seq_scale + (loss - pg["pg_loss"]) * scale).backward()
            all_reduce_gradients(self.model)
            grad_norm = clip_grad_norm(self.model, cfg.optim.grad_clip)
            if not update_is_finite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            n_updates += 1
            terms = [("actor/pg_loss", pg["pg_loss"]), ("actor/pg_clipfrac", pg["pg_clipfrac"]),
                     ("actor/ppo_kl", pg["ppo_kl"]), ("actor/entropy", entropy), ("actor/grad_norm", grad_norm)]
            if cfg.use_kl_loss:
                terms.append(("actor/kl_loss", kl_loss))
            for k, v in terms:
                sums[k] = sums.get(k, 0.0) + (v.detach().double() if torch.is_tensor(v) else float(v))
        step_scheduler(self.scheduler, n_updates)
        self.model.train(False)
        metrics = {k: float(v) / max(1, n_updates) for k, v in sums.items()}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["actor/nonfinite_skipped"] = float(skipped)
        return metrics
