"""Advantage estimators (GAE, GRPO) and the masked statistics they are built on.

Every tensor of per-token values has shape ``[B, T]`` (batch, response length) and comes with a
``response_mask`` of the same shape: 1 for response tokens, 0 for padding. Padded positions never
influence a statistic, and the advantages and returns written there are 0.

The functions are pure and deterministic on CPU and CUDA: reductions are plain ``sum`` calls (no
atomic scatter), so replaying a step after a failure reproduces its advantages bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from resilient_rl.errors import AlgoInputError, ConfigError

__all__ = [
    "AdvantageEstimator",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

# Added to the variance before the inverse square root, as verl does, so a constant batch
# whitens to 0 instead of NaN.
_WHITEN_EPS = 1e-8


def _check_mask(x: torch.Tensor, mask: torch.Tensor, name: str = "x") -> None:
    if x.shape != mask.shape:
        raise AlgoInputError(
            f"{name} has shape {tuple(x.shape)} but the mask has shape {tuple(mask.shape)}; "
            "they must match"
        )


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is non-zero (over ``dim``, or everything)."""
    _check_mask(x, mask)
    # torch.where rather than x * mask: padded positions may hold inf/NaN (e.g. values of a
    # critic past the end of a sequence) and 0 * inf would poison the sum.
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the masked-in positions; 0 where nothing is masked in.

    With ``dim=None`` the result is a scalar over all valid positions (a token mean); with
    ``dim=-1`` it is one mean per sequence.
    """
    total = masked_sum(x, mask, dim)
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    # clamp(min=1) rather than verl's "+1e-8": exact for any non-empty mask, 0 for an empty one.
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked-in positions (a scalar).

    ``unbiased`` applies Bessel's correction n / (n - 1). With fewer than two valid positions
    the variance is 0: whitening a single value then yields 0 rather than stopping a long run
    on an error (verl raises here).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to unit variance over the mask, and to zero mean when ``shift_mean``.

    Statistics come from the masked-in positions only; the formula is applied everywhere, so
    callers that care about padded positions mask the result.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the response tokens (Schulman et al., 2016).

    Computed backwards in time: ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}``. Masked-out positions are skipped: they neither
    contribute a TD error nor break the recursion, so the value after the last valid token is 0
    and padding values (whatever the critic wrote there) are ignored.

    Returns ``(advantages, returns)``, both ``[B, T]`` and 0 at padded positions, where
    ``returns = A + V`` uses the advantages before whitening (the critic's regression target)
    and ``advantages`` are whitened over the mask when ``whiten`` is true (as in verl).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ConfigError(f"lam must be in [0, 1], got {lam}")
    _check_mask(token_level_rewards, response_mask, "token_level_rewards")
    _check_mask(values, response_mask, "values")

    mask = response_mask.to(values.dtype)
    zeros = torch.zeros_like(values)
    # Padding may hold inf/NaN from the critic; keep it out of the arithmetic below.
    values = torch.where(response_mask.bool(), values, zeros)
    rewards = torch.where(response_mask.bool(), token_level_rewards.to(values.dtype), zeros)

    next_values = values.new_zeros(values.shape[0])
    last_gae = values.new_zeros(values.shape[0])
    steps: list[torch.Tensor] = []
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        gae = delta + gamma * lam * last_gae
        # A padded step carries the running value and advantage through unchanged.
        next_values = values[:, t] * m + (1 - m) * next_values
        last_gae = gae * m + (1 - m) * last_gae
        steps.append(last_gae)
    advantages = torch.stack(steps[::-1], dim=1)
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages * mask, returns


def _group_ids(index: Sequence[Any] | np.ndarray, batch_size: int) -> tuple[list[int], int]:
    """Map each entry of ``index`` to a dense group id, in order of first appearance."""
    keys = index.tolist() if isinstance(index, np.ndarray) else list(index)
    if len(keys) != batch_size:
        raise AlgoInputError(
            f"index has {len(keys)} entries but the batch has {batch_size} sequences; "
            "give one prompt uid per sequence"
        )
    ids: dict[Any, int] = {}
    return [ids.setdefault(k, len(ids)) for k in keys], len(ids)


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al., 2024): each response against its prompt's group.

    A sequence's score is the sum of its token rewards over the mask. Sequences sharing a value
    of ``index`` (the prompt uid) form a group; the advantage is ``score - group mean``, divided
    by ``group std + epsilon`` (unbiased std) when ``norm_adv_by_std`` (Dr. GRPO turns it off).
    A group of one response has no baseline: like verl, it uses mean 0 and std 1.

    Returns ``(advantages, returns)``, identical ``[B, T]`` tensors: the sequence advantage
    broadcast over its response tokens, 0 on padding.
    """
    _check_mask(token_level_rewards, response_mask, "token_level_rewards")
    batch_size = token_level_rewards.shape[0]
    group_of, n_groups = _group_ids(index, batch_size)
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)
    dtype, device = scores.dtype, scores.device

    group = torch.tensor(group_of, device=device)
    # A dense [G, B] membership matrix keeps the group reductions as ordinary sums, which are
    # deterministic on CUDA (scatter_add is not); G * B stays small for RL batch sizes.
    member = (group.unsqueeze(0) == torch.arange(n_groups, device=device).unsqueeze(1)).to(dtype)
    count = member.sum(dim=1)
    mean = (member * scores.unsqueeze(0)).sum(dim=1) / count
    sq_dev = (member * (scores.unsqueeze(0) - mean.unsqueeze(1)) ** 2).sum(dim=1)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)

    adv = scores - mean[group]
    if norm_adv_by_std:
        adv = adv / (std[group] + epsilon)
    advantages = adv.unsqueeze(-1) * response_mask.to(dtype)
    return advantages, advantages


class AdvantageEstimator(str, Enum):
    """Names of the advantage estimators, as written in ``algorithm.adv_estimator``."""

    GAE = "gae"
    GRPO = "grpo"


_ESTIMATORS = {
    AdvantageEstimator.GAE: compute_gae_advantage_return,
    AdvantageEstimator.GRPO: compute_grpo_outcome_advantage,
}


def compute_advantage(name: str | AdvantageEstimator, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator called ``name`` with ``kwargs``; returns ``(advantages, returns)``.

    The keyword arguments are those of the estimator's function
    (:func:`compute_gae_advantage_return` or :func:`compute_grpo_outcome_advantage`).
    """
    try:
        estimator = AdvantageEstimator(name)
    except ValueError:
        allowed = ", ".join(e.value for e in AdvantageEstimator)
        raise ConfigError(f"unknown advantage estimator (adv_estimator) {name!r}; allowed: {allowed}") from None
    return _ESTIMATORS[estimator](**kwargs)
