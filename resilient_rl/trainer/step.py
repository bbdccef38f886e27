"""One PPO/GRPO step, written once against a role backend (Ray worker groups or local engines).

The step is a pure function of (roles' state, prompt batch, step number, config): generation
samples from a generator seeded by (seed, step, rank), mini-batches are shuffled by (seed, step),
and the KL controller's value is part of the controller state. That is what makes a run
reproducible bit for bit on CPU, and a replayed step after recovery identical to the original.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch

from resilient_rl.algos.advantages import compute_gae_advantage_return, compute_grpo_outcome_advantage
from resilient_rl.algos.kl import apply_kl_penalty
from resilient_rl.protocol import DataProto
from resilient_rl.telemetry.metrics import PHASES  # noqa: F401 -- the step's phases; defined there, imported here
from resilient_rl.data.tasks import compute_rewards
from resilient_rl.runtime.pool import WorkerPool


class PhaseTimer:
    """Wall time per phase of the current step."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.durations[phase] = self.durations.get(phase, 0.0) + time.perf_counter() - t0

    def each(self, phases: list[str], results: Callable[[], Iterator]) -> Iterator[tuple[str, object]]:
        """``(phase, result)`` for calls in flight together (``results()`` starts them and yields
        their results in order): each phase is charged the wall time from the end of the one before
        it (or the start) until its result has been handled, so the phases still add up to the
        step's time, as when each call ran alone."""
        t = time.perf_counter()
        for phase, result in zip(phases, results()):
            yield phase, result
            now = time.perf_counter()
            self.durations[phase] = self.durations.get(phase, 0.0) + now - t
            t = now


def make_prompts(batch: dict, n: int, meta: dict) -> DataProto:
    """A DataProto of prompts from a loader batch, each prompt repeated ``n`` times (adjacent)."""
    non_tensor = {"prompt_index": np.asarray(batch["prompt_index"]),
                  "answers": np.asarray(batch["answers"], dtype=object)}
    if "data_sources" in batch:  # verl's data: the reward gets each sample's data source and extra info
        non_tensor.update(data_source=batch["data_sources"], extra_info=batch["extra_infos"])
    prompts = DataProto.from_dict({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                                  non_tensor, dict(meta))
    return prompts.repeat(n, interleave=True) if n > 1 else prompts


def token_level_scores(scores: np.ndarray, response_mask: torch.Tensor) -> torch.Tensor:
    """The sequence score on the last response token, zero elsewhere."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = torch.from_numpy(scores.astype(np.float32))
    return out * response_mask


#: The key of run_step's metrics that carries why the rollout decodes eagerly (not a metric).
DECODE_EAGER_REASON = "decode_eager_reason"


def _per_rank(metrics: dict | list | None) -> list[dict]:
    """Per-rank metric dicts from a merged ``meta_info["metrics"]`` (a dict of lists, or one dict)."""
    if not metrics:
        return []
    if isinstance(metrics, list):
        return metrics
    lists = {k: v if isinstance(v, list) else [v] for k, v in metrics.items()}
    return [dict(zip(lists, values)) for values in zip(*lists.values())]


def _mean_metrics(per_rank: list[dict]) -> dict[str, float]:
    keys = per_rank[0].keys() if per_rank else []
    return {k: float(np.mean([m[k] for m in per_rank])) for k in keys}


def run_step(roles: WorkerPool, batch: dict, step: int, cfg, task, tokenizer, kl_ctrl, version: int,
             before_sync: Callable[[], None] | None = None) -> tuple[dict, dict]:
    """Run step ``step`` (1-based) on ``batch``; returns (metrics, phase durations in seconds).

    On entry the rollout holds weights ``version`` (== step - 1); on exit it holds ``version + 1``.
    ``before_sync`` is called once the updates are done, right before the weight sync.
    """
    timer = PhaseTimer()
    algo = cfg.algorithm
    meta = {"seed": cfg.trainer.seed, "step": step, "weights_version": version}
    prompts = make_prompts(batch, cfg.rollout.n, meta)

    with timer("gen"):
        data = roles.generate(prompts)
    engine_metrics: dict = _mean_metrics(_per_rank(data.meta_info.pop("metrics", None)))
    if "decode_eager_reason" in data.meta_info:  # popped by the trainer into a decode_eager event
        engine_metrics[DECODE_EAGER_REASON] = data.meta_info.pop("decode_eager_reason")
    data.non_tensor_batch.update(prompts.non_tensor_batch)
    data.meta_info.update(meta)
    mask = data.batch["response_mask"]
    extras = data.non_tensor_batch
    scores = compute_rewards(task, tokenizer, data.batch["responses"] * mask + tokenizer.pad_token_id * (1 - mask),
                             list(extras["answers"]), extras.get("data_source"), extras.get("extra_info"))
    # A NaN/Inf score would poison the advantages of its whole group (GRPO) or batch (whitening):
    # it scores as a failed response instead, and the trainer's non-finite guard reports the count.
    bad_scores = ~np.isfinite(scores)
    scores = np.where(bad_scores, np.float32(0.0), scores)
    data.batch["token_level_scores"] = token_level_scores(scores, mask)

    # The forward passes depend on the rollout's data only: all in flight at once.
    need_ref = algo.use_kl_in_reward or cfg.actor.use_kl_loss
    forward = ([("ref", "compute_ref_log_prob")] if need_ref else []) + [("old_log_prob", "compute_log_prob")] \
        + ([("values", "compute_values")] if roles.critic_enabled else [])
    for _, out in timer.each([p for p, _ in forward], lambda: roles.concurrently([(m, data) for _, m in forward])):
        data.union(out)

    with timer("adv"):
        metrics: dict[str, float] = {}
        if algo.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(data.batch["token_level_scores"], data.batch["old_log_probs"],
                                                   data.batch["ref_log_prob"], mask.float(), kl_ctrl,
                                                   algo.kl_penalty)
            metrics.update({k: float(v) for k, v in kl_metrics.items()})
        else:
            rewards = data.batch["token_level_scores"]
        data.batch["token_level_rewards"] = rewards
        if algo.adv_estimator == "grpo":
            adv, ret = compute_grpo_outcome_advantage(rewards, mask.float(), data.non_tensor_batch["prompt_index"],
                                                      norm_adv_by_std=algo.norm_adv_by_std_in_grpo)
        else:
            adv, ret = compute_gae_advantage_return(rewards, data.batch["values"], mask.float(), algo.gamma, algo.lam,
                                                    whiten=algo.whiten_advantages)
        data.batch["advantages"], data.batch["returns"] = adv, ret

    # The critic's and the actor's updates are independent: both in flight at once.
    updates = (["update_critic"] if roles.critic_enabled else []) + ["update_actor"]
    for _, per_rank in timer.each(updates, lambda: roles.concurrently([(u, data) for u in updates])):
        metrics.update(_mean_metrics(per_rank))
    if before_sync is not None:
        before_sync()
    with timer("weight_sync"):
        metrics.update(roles.sync_weights(version + 1))

    tokens = int(data.batch["attention_mask"].sum())
    metrics.update(engine_metrics)
    metrics.update({
        "reward/mean": float(scores.mean()),
        "reward/exact_ratio": float((scores >= 1.0).mean()),
        "reward/nonfinite": float(bad_scores.sum()),
        "response_length/mean": float(mask.sum(dim=1).float().mean()),
        "tokens": float(tokens),
    })
    return metrics, timer.durations
