"""KL penalties between the policy and the reference model, and the KL coefficient controllers.

The per-token estimators follow Schulman's "Approximating KL divergence" note (k1, k2, k3) with
verl's names as aliases. The controllers hold the KL coefficient ``beta``; their state is a dict of
plain Python floats so the trainer can checkpoint it as JSON and a resumed run continues with the
same ``beta``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from resilient_rl.algos.advantages import masked_mean
from resilient_rl.errors import CheckpointError, ConfigError

__all__ = [
    "KL_PENALTY_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "get_kl_controller",
    "kl_penalty",
]

# Canonical kind -> accepted spellings (verl's names are the aliases).
_KIND_ALIASES: dict[str, tuple[str, ...]] = {
    "k1": ("k1", "kl"),
    "abs": ("abs",),
    "k2": ("k2", "mse"),
    "k3": ("k3", "low_var_kl"),
}
_CANONICAL = {alias: kind for kind, aliases in _KIND_ALIASES.items() for alias in aliases}
KL_PENALTY_KINDS: tuple[str, ...] = tuple(_CANONICAL)

# k3 exponentiates the log-ratio: bound it first so exp() cannot overflow, then bound the
# estimate itself, as verl does, so one wild token cannot dominate a batch.
_K3_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens.

    Kinds: ``"k1"``/``"kl"``: ``logp - ref``; ``"abs"``: ``|logp - ref|``; ``"k2"``/``"mse"``:
    ``0.5 * (logp - ref)^2``; ``"k3"``/``"low_var_kl"``: ``exp(ref - logp) - (ref - logp) - 1``,
    clamped to [-10, 10]. The result keeps the inputs' autograd graph (it serves as a KL loss).
    """
    canonical = _CANONICAL.get(kind)
    if canonical is None:
        raise ConfigError(f"unknown KL penalty kind (kl_penalty) {kind!r}; allowed: {', '.join(KL_PENALTY_KINDS)}")
    diff = logprob - ref_logprob
    if canonical == "k1":
        return diff
    if canonical == "abs":
        return diff.abs()
    if canonical == "k2":
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, min=-_K3_LOG_RATIO_CLAMP, max=_K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-_K3_CLAMP, max=_K3_CLAMP)


def _float_from_state(state: dict[str, Any], key: str, owner: str) -> float:
    if key not in state:
        raise CheckpointError(f"{owner} state has no {key!r} (keys: {sorted(state)})")
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"{owner} state {key!r} must be a finite number, got {value!r}")
    return float(value)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ConfigError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        """The coefficient, as a JSON-serialisable dict."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        self.value = _float_from_state(state, "value", type(self).__name__)


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. (2019), as in verl.

    After each batch, ``beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``:
    ``beta`` grows while the measured KL is above the target and shrinks while it is below,
    by at most 20% per ``horizon`` samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not init_kl_coef >= 0:
            raise ConfigError(f"init_kl_coef (kl_coef) must be >= 0, got {init_kl_coef}")
        if not target_kl > 0:
            raise ConfigError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ConfigError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient to the KL measured over the last ``n_steps`` samples.

        A non-finite ``current_kl`` (a NaN or Inf log-prob upstream) leaves the coefficient as it
        is: once ``beta`` is NaN every later reward is NaN, and a checkpoint of it cannot be
        resumed. The caller reports such a KL (see :func:`apply_kl_penalty`)."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        value = self.value * (1.0 + error * n_steps / self.horizon)
        if math.isfinite(value):  # an absurd n_steps/horizon must not overflow it either
            self.value = value

    def state_dict(self) -> dict[str, float]:
        """The current coefficient (the only part that changes during training)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`; target and horizon come from config."""
        self.value = _float_from_state(state, "value", type(self).__name__)


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """Build the controller named by ``kind`` (``"fixed"`` or ``"adaptive"``, verl's ``kl_ctrl.type``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ConfigError("kl_ctrl.type 'adaptive' needs kl_ctrl.target_kl and kl_ctrl.horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ConfigError(f"unknown KL controller type (kl_ctrl.type) {kind!r}; allowed: fixed, adaptive")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Fold the KL penalty into the rewards: ``rewards = scores - beta * kl`` on response tokens.

    ``beta`` is the controller's value before this batch. The batch's KL (per-sequence masked
    mean, averaged over sequences) is then fed to ``kl_ctrl.update`` with ``n_steps`` = batch
    size. Metrics: ``actor/reward_kl_penalty`` (that KL) and ``actor/reward_kl_penalty_coeff``
    (``beta``), as plain floats, and ``actor/reward_kl_nonfinite`` (1.0 when the batch's KL was
    NaN or Inf: the controller was not updated and the step's rewards are not to be trusted).
    """
    kld = kl_penalty(logprob, ref_logprob, kind)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta,
               "actor/reward_kl_nonfinite": 0.0 if math.isfinite(current_kl) else 1.0}
    return token_level_rewards, metrics
