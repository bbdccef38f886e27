"""PPO losses (clipped policy surrogate, clipped value loss), loss aggregation, and the
log-prob / entropy helpers that turn a model's logits into the tensors the losses consume.

Loss tensors keep their autograd graph; diagnostics (clip fractions, approximate KL) are
detached so logging them never holds on to a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from resilient_rl.algos.advantages import masked_mean, masked_sum
from resilient_rl.errors import AlgoInputError, ConfigError

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "ppo_policy_loss",
    "value_loss",
]

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Bound on |log_prob - old_log_prob| before exp(), as verl does: a diverged token must not
# turn the ratio into inf (its loss term is clipped or pessimistic anyway).
_LOG_RATIO_CLAMP = 20.0

# Logits are processed this many elements at a time so that the temporaries of logsumexp/softmax
# (and an fp32 copy of bf16 logits) never cover the whole [B, T, V] tensor at once.
_CHUNK_ELEMENTS = 1 << 24


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar over the masked-in tokens.

    - ``"token-mean"``: mean over all valid tokens of the batch (long answers weigh more).
    - ``"seq-mean-token-sum"``: sum over each sequence's tokens, then mean over sequences.
    - ``"seq-mean-token-mean"``: mean over each sequence's tokens, then mean over sequences.

    Sequences without any valid token are left out of the sequence means (as recent verl does),
    so an empty response neither divides by zero nor drags the mean towards 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    has_tokens = mask.bool().any(dim=-1)
    if mode == "seq-mean-token-sum":
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
    else:
        seq_losses = masked_mean(loss_mat, mask, dim=-1)
    return masked_mean(seq_losses, has_tokens)


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    clip_ratio_c: float | None = None,
) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al., 2017), minimised.

    Per token: ``max(-A * r, -A * clip(r, 1 - low, 1 + high))`` with ``r = exp(log_prob - old_log_prob)``;
    ``low`` / ``high`` default to ``clip_ratio`` (set them apart for DAPO's "clip-higher"). With
    ``clip_ratio_c`` (dual-clip PPO, as verl computes it), a token with a negative advantage
    loses at most ``-A * clip_ratio_c``.

    Returns ``pg_loss`` (scalar, differentiable w.r.t. ``log_prob``), ``pg_clipfrac`` (share of
    valid tokens where the clipped term was taken), ``pg_clipfrac_lower`` (share where the dual
    clip was, 0 without it) and ``ppo_kl`` (masked mean of ``old_log_prob - log_prob``), the last
    three detached.
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    for key, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if not value >= 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    for name, tensor in (("old_log_prob", old_log_prob), ("advantages", advantages), ("log_prob", log_prob)):
        if tensor.shape != response_mask.shape:
            raise AlgoInputError(
                f"{name} has shape {tuple(tensor.shape)}, response_mask {tuple(response_mask.shape)}"
            )

    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(torch.clamp(log_ratio, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP))
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped)
    dual = torch.zeros_like(pg_losses, dtype=torch.bool)
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1:
            raise ConfigError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (pg_losses > bound)
        pg_losses = torch.where(dual, bound, pg_losses)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)

    with torch.no_grad():
        pg_clipfrac = masked_mean((losses_clipped > losses_unclipped).to(pg_losses.dtype), response_mask)
        pg_clipfrac_lower = masked_mean(dual.to(pg_losses.dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return {"pg_loss": pg_loss, "pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}


def value_loss(
    vpreds: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``.

    Returns ``(vf_loss, vf_clipfrac)``: the loss aggregated over the mask (token mean by
    default, differentiable w.r.t. ``vpreds``) and the detached share of valid tokens where the
    clipped term was the larger one.
    """
    if not cliprange_value >= 0:
        raise ConfigError(f"cliprange_value must be >= 0, got {cliprange_value}")
    vpred_clipped = torch.clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value)
    losses_unclipped = (vpreds - returns) ** 2
    losses_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(losses_unclipped, losses_clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        vf_clipfrac = masked_mean((losses_clipped > losses_unclipped).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # bf16/fp16 log-probs are too coarse for importance ratios: compute in fp32.
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def _rowwise(logits: torch.Tensor, fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> torch.Tensor:
    """Apply ``fn(rows, start, end)`` to chunks of the flattened ``[N, V]`` logits and concatenate."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    dtype = _compute_dtype(logits)
    parts = [
        fn(flat[start:start + rows].to(dtype), start, min(start + rows, flat.shape[0]))
        for start in range(0, flat.shape[0], rows)
    ]
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=dtype)
    return out.reshape(logits.shape[:-1])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` ``[..., V]``, shape ``[...]``.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)`` on logits shifted by their row maximum:
    the shift leaves ``H`` unchanged but avoids subtracting two large, nearly equal numbers
    when the logits are far from 0. Half-precision logits give an fp32 result.
    """

    def chunk(z: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # The max is a constant w.r.t. H, so detaching it leaves the gradient exact.
        z = z - z.amax(dim=-1, keepdim=True).detach()
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)

    return _rowwise(logits, chunk)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` ``[...]`` under ``logits`` ``[..., V]``, shape ``[...]``.

    Computed as ``z[label] - logsumexp(z)`` chunk by chunk, so no full ``[..., V]`` log-softmax
    is materialised. Half-precision logits give an fp32 result.
    """
    if labels.shape != logits.shape[:-1]:
        raise AlgoInputError(
            f"labels have shape {tuple(labels.shape)}, expected logits' leading shape {tuple(logits.shape[:-1])}"
        )
    flat_labels = labels.reshape(-1, 1)

    def chunk(z: torch.Tensor, start: int, end: int) -> torch.Tensor:
        picked = torch.gather(z, dim=-1, index=flat_labels[start:end]).squeeze(-1)
        return picked - torch.logsumexp(z, dim=-1)

    return _rowwise(logits, chunk)
