"""RL algorithms: advantage estimators, losses, KL penalties."""

from resilient_rl.algos.advantages import (
    AdvantageEstimator,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from resilient_rl.algos.kl import (
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from resilient_rl.algos.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)

__all__ = [
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "entropy_from_logits",
    "get_kl_controller",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "value_loss",
]
