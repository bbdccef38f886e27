"""Tests of resilient_rl.algos against values worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from resilient_rl.algos import (
    AdaptiveKLController,
    AdvantageEstimator,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)
from resilient_rl.errors import AlgoInputError, CheckpointError, ConfigError

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_var_ignore_padding_even_nan():
    x = t([[1.0, 2.0, 3.0, float("nan")]])
    mask = t([[1, 1, 1, 0]])
    assert masked_mean(x, mask).item() == 2.0
    # unbiased: ((1-2)^2 + 0 + (3-2)^2) / (3 - 1) = 1; biased: 2/3
    assert masked_var(x, mask).item() == pytest.approx(1.0)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    # per row: row 0 -> (1+2)/2 = 1.5, row 1 -> empty -> 0
    rows = masked_mean(t([[1.0, 2.0], [5.0, 6.0]]), t([[1, 1], [0, 0]]), dim=-1)
    assert rows.tolist() == [1.5, 0.0]


def test_masked_whiten():
    x = t([[1.0, 2.0, 3.0, 100.0]])
    mask = t([[1, 1, 1, 0]])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8)
    white = masked_whiten(x, mask)
    assert_close(white[0, :3], t([-1.0, 0.0, 1.0]) / math.sqrt(1 + 1e-8))
    # shift_mean=False adds the mean back: 1, 2, 3
    assert_close(masked_whiten(x, mask, shift_mean=False)[0, :3], t([1.0, 2.0, 3.0]), atol=1e-7, rtol=0)


def test_masked_stats_reject_mismatched_mask():
    with pytest.raises(AlgoInputError, match="shape"):
        masked_mean(t([[1.0, 2.0]]), t([[1, 1, 1]]))


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed_1x3_without_whitening():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    mask = t([[1, 1, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # gamma * lam = 0.72; value after the last token is 0.
    # t=2: delta = 1 + 0.9*0   - 0.7 = 0.3   ; A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03  ; A1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04  ; A0 = 0.04 + 0.72*0.246 = 0.21712
    assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    # returns = A + V = 0.71712, 0.846, 1.0
    assert_close(ret, t([[0.71712, 0.846, 1.0]]))


def test_gae_padded_position_is_ignored():
    rewards = t([[0.0, 1.0, 0.0]])
    values = t([[0.5, 0.6, 9.0]])  # the critic's output on the pad must not matter
    mask = t([[1, 1, 0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # t=1 is the last valid token, so V_2 counts as 0:
    # t=1: delta = 1 + 0.9*0   - 0.6 = 0.4   ; A1 = 0.4
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04  ; A0 = 0.04 + 0.72*0.4 = 0.328
    assert_close(adv, t([[0.328, 0.4, 0.0]]))
    # returns = A + V on valid tokens, 0 on the pad: 0.828, 1.0, 0
    assert_close(ret, t([[0.828, 1.0, 0.0]]))


def test_gae_whitening_is_over_the_mask_and_returns_unwhitened():
    rewards = t([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 9.0], [0.5, 0.6, 0.7]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # raw advantages from the two tests above: 0.328, 0.4 | 0.21712, 0.246, 0.3
    raw = t([0.328, 0.4, 0.21712, 0.246, 0.3])
    expected = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    assert_close(adv[mask.bool()], expected)
    assert adv[0, 2].item() == 0.0
    assert_close(ret, t([[0.828, 1.0, 0.0], [0.71712, 0.846, 1.0]]))


def test_gae_rejects_out_of_range_gamma():
    z = t([[0.0]])
    with pytest.raises(ConfigError, match="gamma"):
        compute_gae_advantage_return(z, z, t([[1]]), gamma=1.5, lam=0.9)


# ---------------------------------------------------------------- GRPO


def test_grpo_two_groups_one_singleton():
    # Sequence scores (sum of token rewards over the mask): a: 1, 0, 2; b: 3.
    rewards = t([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    eps = 1e-6
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=eps)
    # group a: mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 -> (s - 1) / (1 + eps) = 0, -1, 1
    # group b has one member: mean 0, std 1 -> 3 / (1 + eps)
    per_seq = t([0.0, -1.0, 1.0, 3.0]) / (1 + eps)
    assert_close(adv, per_seq[:, None] * mask)
    assert adv[1, 2].item() == 0.0  # padding stays 0
    assert torch.equal(adv, ret)

    adv_nostd, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)
    # without std normalisation: s - mean = 0, -1, 1 and 3 - 0
    assert_close(adv_nostd, t([0.0, -1.0, 1.0, 3.0])[:, None] * mask)


def test_grpo_group_order_does_not_matter_and_index_length_checked():
    rewards = t([[1.0], [3.0], [2.0], [4.0]])
    mask = t([[1], [1], [1], [1]])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([7, 8, 7, 8]), norm_adv_by_std=False)
    # group 7: scores 1, 2 (mean 1.5); group 8: scores 3, 4 (mean 3.5)
    assert adv[:, 0].tolist() == [-0.5, -0.5, 0.5, 0.5]
    with pytest.raises(AlgoInputError, match="index has 3 entries"):
        compute_grpo_outcome_advantage(rewards, mask, np.array([7, 8, 7]))


def test_compute_advantage_dispatch():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    mask = t([[1, 1, 1]])
    adv, _ = compute_advantage("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                               gamma=0.9, lam=0.8, whiten=False)
    assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    adv, _ = compute_advantage(AdvantageEstimator.GRPO, token_level_rewards=rewards, response_mask=mask,
                               index=np.array(["x"]))
    assert_close(adv, t([[1.0, 1.0, 1.0]]) / (1 + 1e-6))
    with pytest.raises(ConfigError, match="'reinforce'.*gae, grpo"):
        compute_advantage("reinforce")


# ---------------------------------------------------------------- KL


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # (logp, ref) = (-1, -1.5): d = logp - ref = 0.5   |   (-2, -1): d = -1
        ("k1", [0.5, -1.0]),
        ("kl", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),  # 0.5 * d^2
        ("k2", [0.125, 0.5]),
        # k3 with x = ref - logp: e^x - x - 1 -> x=-0.5: e^-0.5 + 0.5 - 1; x=1: e - 2
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2]),
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2]),
    ],
)
def test_kl_penalty_kinds(kind, expected):
    out = kl_penalty(t([-1.0, -2.0]), t([-1.5, -1.0]), kind)
    assert_close(out, t(expected))


def test_kl_k3_is_clamped_and_unknown_kind_rejected():
    # x = ref - logp = 30: e^20 - 20 - 1 after the inner clamp, then clamped to 10
    assert kl_penalty(t([-30.0]), t([0.0]), "k3").item() == 10.0
    with pytest.raises(ConfigError, match="'full'.*low_var_kl"):
        kl_penalty(t([0.0]), t([0.0]), "full")


def test_adaptive_kl_controller_update_and_state():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    # error = 0.055 / 0.05 - 1 = 0.1 (inside +-0.2); mult = 1 + 0.1 * 10 / 100 = 1.01 -> 0.101
    ctrl.update(current_kl=0.055, n_steps=10)
    assert ctrl.value == pytest.approx(0.101, rel=1e-12)
    # error = 1.0 / 0.05 - 1 = 19 -> clipped to 0.2; mult = 1.02 -> 0.101 * 1.02 = 0.10302
    ctrl.update(current_kl=1.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.10302, rel=1e-12)
    # error = 0 / 0.05 - 1 = -1 -> clipped to -0.2; mult = 0.98 -> 0.1009596
    ctrl.update(current_kl=0.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.1009596, rel=1e-12)

    state = json.loads(json.dumps(ctrl.state_dict()))
    restored = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    restored.load_state_dict(state)
    assert restored.value == ctrl.value
    with pytest.raises(CheckpointError, match="'value'"):
        restored.load_state_dict({})


def test_fixed_kl_controller_and_factory():
    ctrl = get_kl_controller("fixed", kl_coef=0.3)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=5.0, n_steps=100)
    assert ctrl.value == 0.3
    assert json.loads(json.dumps(ctrl.state_dict())) == {"value": 0.3}
    assert isinstance(get_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=10), AdaptiveKLController)
    with pytest.raises(ConfigError, match="target_kl"):
        get_kl_controller("adaptive", 0.1)
    with pytest.raises(ConfigError, match="horizon"):
        AdaptiveKLController(0.1, 0.05, horizon=0)


def test_apply_kl_penalty_rewards_metrics_and_update():
    scores = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logprob = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    ref = torch.zeros_like(logprob)
    mask = t([[1, 1, 1], [1, 1, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.25, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, logprob, ref, mask, ctrl, kind="k1")
    # k1 = logprob - ref; rewards = scores - 0.5 * kl on valid tokens; the pad keeps its score
    assert_close(rewards, t([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))
    # per-sequence KL: mean(0.1, 0.2, 0.3) = 0.2, mean(0.4, 0.5) = 0.45 -> batch 0.325
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.325)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # beta before the update
    # update with n_steps = batch size 2: error = 0.325/0.25 - 1 = 0.3 -> 0.2; 0.5 * (1 + 0.2*2/10) = 0.52
    assert ctrl.value == pytest.approx(0.52)


# ---------------------------------------------------------------- losses


def test_agg_loss_modes():
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third sequence is empty
    # token-mean: (1 + 2 + 4) / 3
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    # seq-mean-token-sum: sums 3 and 4 over the two non-empty sequences -> 3.5
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    # seq-mean-token-mean: means 1.5 and 4 -> 2.75
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    with pytest.raises(ConfigError, match="'sum'.*token-mean"):
        agg_loss(loss, mask, "sum")


def test_ppo_policy_loss_clipping_both_sides():
    # old log-prob 0, so ratio r = exp(log_prob). clip range [0.8, 1.2].
    ratios = t([[1.5, 0.5, 1.0, 1.5, 3.0]])
    adv = t([[1.0, -1.0, 1.0, -1.0, 1.0]])
    mask = t([[1, 1, 1, 1, 0]])
    log_prob = torch.log(ratios).requires_grad_(True)
    out = ppo_policy_loss(torch.zeros_like(log_prob), log_prob, adv, mask, clip_ratio=0.2)
    # token 0: A=+1 r=1.5: max(-1.5, -1.2) = -1.2   clipped (upper side)
    # token 1: A=-1 r=0.5: max( 0.5,  0.8) =  0.8   clipped (lower side)
    # token 2: A=+1 r=1.0: max(-1.0, -1.0) = -1.0   not clipped
    # token 3: A=-1 r=1.5: max( 1.5,  1.2) =  1.5   not clipped (pessimistic term is unclipped)
    # token 4: padding
    # pg_loss = (-1.2 + 0.8 - 1.0 + 1.5) / 4 = 0.025 ; clipfrac = 2 / 4
    assert out["pg_loss"].item() == pytest.approx(0.025)
    assert out["pg_clipfrac"].item() == pytest.approx(0.5)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + 0 + ln 1.5) / 4
    assert out["ppo_kl"].item() == pytest.approx(-(2 * math.log(1.5) + math.log(0.5)) / 4)
    assert not out["pg_clipfrac"].requires_grad and not out["ppo_kl"].requires_grad

    out["pg_loss"].backward()
    # d/dlogp of -A*r = -A*r on unclipped tokens, 0 on clipped and padded ones, / 4 tokens:
    # token 2: -1 * 1.0 / 4 = -0.25 ; token 3: +1 * 1.5 / 4 = 0.375
    assert_close(log_prob.grad, t([[0.0, 0.0, -0.25, 0.375, 0.0]]))


def test_ppo_policy_loss_asymmetric_clip():
    ratios = t([[1.5, 0.5]])
    adv = t([[1.0, -1.0]])
    mask = t([[1, 1]])
    out = ppo_policy_loss(torch.zeros(1, 2, dtype=D), torch.log(ratios), adv, mask,
                          clip_ratio_low=0.2, clip_ratio_high=0.28)
    # token 0: -1 * clip(1.5, 0.8, 1.28) = -1.28 ; token 1: +1 * clip(0.5) = 0.8 -> mean -0.24
    assert out["pg_loss"].item() == pytest.approx(-0.24)
    assert out["pg_clipfrac"].item() == 1.0


def test_value_loss_clipping():
    # cliprange 0.2 around values_old = 0
    vpreds = t([[0.5, 0.5, 0.1, 5.0]]).requires_grad_(True)
    values_old = t([[0.0, 0.0, 0.0, 0.0]])
    returns = t([[1.0, 0.0, 1.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, clipfrac = value_loss(vpreds, values_old, returns, mask, cliprange_value=0.2)
    # token 0: v=0.5 -> clipped 0.2; (0.5-1)^2 = 0.25 vs (0.2-1)^2 = 0.64 -> 0.64 (clipped)
    # token 1: v=0.5 -> clipped 0.2; (0.5-0)^2 = 0.25 vs (0.2-0)^2 = 0.04 -> 0.25
    # token 2: v=0.1 inside the range: 0.81 both
    # loss = 0.5 * (0.64 + 0.25 + 0.81) / 3 = 0.28333..., clipfrac = 1/3
    assert loss.item() == pytest.approx(0.5 * 1.7 / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dv: token 0 takes the clipped term (flat in v) -> 0; token 1: 0.5*2*(0.5-0)/3 = 1/6;
    # token 2: 0.5*2*(0.1-1)/3 = -0.3
    assert_close(vpreds.grad, t([[0.0, 1 / 6, -0.3, 0.0]]))


def test_entropy_of_uniform_is_log_vocab():
    vocab = 7
    for shift in (0.0, 1000.0):  # a large shift would overflow a naive exp()
        ent = entropy_from_logits(torch.full((2, 3, vocab), shift))
        assert ent.shape == (2, 3)
        assert_close(ent, torch.full((2, 3), math.log(vocab)))


def test_entropy_matches_categorical():
    logits = torch.randn(2, 4, 11, generator=torch.Generator().manual_seed(0), requires_grad=True)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    got = entropy_from_logits(logits)
    assert_close(got, expected)
    # usable as an entropy bonus: same gradient as the reference
    assert_close(torch.autograd.grad(got.sum(), logits)[0], torch.autograd.grad(expected.sum(), logits)[0])


def test_logprobs_from_logits_matches_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 13, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (3, 5), generator=gen)
    got = logprobs_from_logits(logits, labels)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(got, expected)
    # the gradient flows back to the logits
    (g,) = torch.autograd.grad(got.sum(), logits)
    (g_ref,) = torch.autograd.grad(expected.sum(), logits)
    assert_close(g, g_ref)

    # bf16 logits are evaluated in fp32
    got_bf16 = logprobs_from_logits(logits.detach().bfloat16(), labels)
    assert got_bf16.dtype == torch.float32
    ref_bf16 = torch.log_softmax(logits.detach().bfloat16().float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(got_bf16, ref_bf16)

    with pytest.raises(AlgoInputError, match="labels"):
        logprobs_from_logits(logits, labels[:, :4])


def test_logprobs_chunking_gives_same_result(monkeypatch):
    import resilient_rl.algos.losses as losses

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 9, generator=gen)
    labels = torch.randint(0, 9, (4, 6), generator=gen)
    whole = logprobs_from_logits(logits, labels)
    # force chunks of 2 rows (18 elements / 9 vocab), so 12 chunks with boundaries mid-batch
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 18)
    assert torch.equal(logprobs_from_logits(logits, labels), whole)
    assert_close(entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy())


def test_dual_clip_bounds_the_loss_of_a_negative_advantage_as_verl_does():
    # ratio 5, 2 and 5 (log 5, log 2): A = -1 at ratio 5: max(5, 1.2) = 5, bounded by 3 * 1 = 3;
    # A = -1 at ratio 2: max(2, 1.2) = 2 < 3, kept; A = +1 at ratio 5: max(-5, -1.2) = -1.2, never bounded.
    old = t([[0.0, 0.0, 0.0]])
    new = t([[math.log(5.0), math.log(2.0), math.log(5.0)]])
    adv, mask = t([[-1.0, -1.0, 1.0]]), t([[1.0, 1.0, 1.0]])
    out = ppo_policy_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    assert_close(out["pg_loss"], t((3.0 + 2.0 - 1.2) / 3))
    assert_close(out["pg_clipfrac_lower"], t(1 / 3))
    plain = ppo_policy_loss(old, new, adv, mask, clip_ratio=0.2)
    assert_close(plain["pg_loss"], t((5.0 + 2.0 - 1.2) / 3))
    assert_close(plain["pg_clipfrac_lower"], t(0.0))
    with pytest.raises(ConfigError, match="clip_ratio_c must be > 1"):
        ppo_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)
