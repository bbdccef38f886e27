"""The policy update honours actor.loss_agg_mode (one process, no process group)."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.errors import CollectiveError
from resilient_rl.protocol import DataProto
from resilient_rl.config.schema import load_config
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine


def _batch(n: int = 8, prompt: int = 4, resp: int = 4, vocab: int = 12) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, prompt + resp), generator=gen)
    mask = torch.ones(n, resp)
    mask[: n // 2, 1:] = 0  # half the responses are one token long: sequence and token means differ
    data = DataProto.from_dict({
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, prompt:],
        "position_ids": torch.arange(prompt + resp).expand(n, -1).clone(), "response_mask": mask,
        "old_log_probs": -torch.rand(n, resp, generator=gen) - 2.0, "advantages": torch.randn(n, resp, generator=gen)})
    data.meta_info["seed"] = 1
    return data


def _weights_after_update(mode: str) -> dict[str, torch.Tensor]:
    cfg = load_config(None, [f"actor.loss_agg_mode={mode}", "actor.ppo_epochs=1", "actor.mini_batch_size=8",
                             "actor.optim.warmup_steps=0", "model.hidden_size=16", "model.num_layers=1",
                             "model.num_heads=2", "model.intermediate_size=32"])
    engine = PolicyEngine(cfg.model, 12, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    engine.update(_batch(), step=1)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_loss_agg_mode_changes_the_update_and_is_deterministic():
    token = _weights_after_update("token-mean")
    assert all(torch.equal(token[k], v) for k, v in _weights_after_update("token-mean").items())
    seq = _weights_after_update("seq-mean-token-mean")
    assert any(not torch.equal(token[k], seq[k]) for k in token)


def test_update_with_kl_loss_reports_it_once_and_raises_no_warning():
    """GRPO's KL loss is read for the metrics without PyTorch's requires_grad warning, which every
    rank would print into the run's log on every step, and counted once per update."""
    import warnings

    from resilient_rl.algos.kl import kl_penalty

    cfg = load_config(None, ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.ppo_epochs=1",
                             "actor.mini_batch_size=8", "model.hidden_size=16", "model.num_layers=1",
                             "model.num_heads=2", "model.intermediate_size=32"])
    engine = PolicyEngine(cfg.model, 12, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    data = _batch()
    data.batch["ref_log_prob"] = data.batch["old_log_probs"] - 0.1
    logp = engine.compute_log_prob(data).batch["log_probs"]  # the weights the single update starts from
    mask = data.batch["response_mask"]
    expected = float((kl_penalty(logp, data.batch["ref_log_prob"], cfg.actor.kl_loss_type) * mask).sum() / mask.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics = engine.update(data, step=1)
    assert metrics["actor/kl_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_rank_of_a_group_with_no_process_group_refuses_to_update_alone(monkeypatch):
    """A process Ray restarted that has not joined its group (rank 1 of 2, no process group) would
    average its gradients with nobody and take twice its share of each mini-batch: its update
    raises a collective error (the recovery then rejoins its group) and leaves the weights as
    they were."""
    cfg = load_config(None, ["actor.ppo_epochs=1", "actor.mini_batch_size=8", "model.hidden_size=16",
                             "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32"])
    engine = PolicyEngine(cfg.model, 12, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(CollectiveError, match="rank 1 of a group of 2 has no process group"):
        engine.update(_batch(), step=1)
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_every_loss_term_is_aggregated_by_loss_agg_mode_whatever_the_micro_batches(mode):
    """The policy loss, the entropy bonus and the KL loss are each aggregated by the mode, as verl
    aggregates them: the gradient of a mini-batch taken in two micro-batches is that of the
    reference loss over the whole of it (before, entropy and KL loss were token means in every mode,
    so their coefficients weighed a sequence sum about a response length less than in verl)."""
    from resilient_rl.algos.kl import kl_penalty
    from resilient_rl.algos.losses import agg_loss, ppo_policy_loss
    from resilient_rl.workers.logprob import full_response_logprobs

    cfg = load_config(None, [f"actor.loss_agg_mode={mode}", "actor.entropy_coeff=0.05", "actor.use_kl_loss=true",
                             "actor.kl_loss_coef=0.5", "actor.micro_batch_tokens=40", "model.hidden_size=16",
                             "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32"])
    engine = PolicyEngine(cfg.model, 12, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    data = _batch()
    data.batch["ref_log_prob"] = data.batch["old_log_probs"] - 0.3 * torch.rand(8, 4)
    m = data.batch["response_mask"]
    engine._accumulate(data, m, m.sum(), m.bool().any(dim=-1).sum(), world=1, n_parts=2)
    got = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    engine.model.zero_grad(set_to_none=True)
    logp, ent = full_response_logprobs(engine.model, data.batch, torch.device("cpu"))
    b = data.batch
    pg = ppo_policy_loss(b["old_log_probs"], logp, b["advantages"], m, clip_ratio=cfg.actor.clip_ratio,
                         loss_agg_mode=mode)["pg_loss"]
    kl = kl_penalty(logp, b["ref_log_prob"], cfg.actor.kl_loss_type)
    (pg - 0.05 * agg_loss(ent, m, mode) + 0.5 * agg_loss(kl, m, mode)).backward()
    for n, p in engine.model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-7), n


@pytest.mark.parametrize("shuffle", [True, False])
def test_mini_batches_are_shuffled_every_epoch_or_taken_in_order(shuffle):
    cfg = load_config(None, [f"actor.shuffle={str(shuffle).lower()}", "actor.ppo_epochs=2", "actor.mini_batch_size=4",
                             "model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
                             "model.intermediate_size=32"])
    engine = PolicyEngine(cfg.model, 12, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    data = _batch()
    row_of = {tuple(ids.tolist()): i for i, ids in enumerate(data.batch["input_ids"])}
    seen, accumulate = [], engine._accumulate
    engine._accumulate = lambda mb, *args: seen.append([row_of[tuple(r.tolist())] for r in mb.batch["input_ids"]]) \
        or accumulate(mb, *args)
    engine.update(data, step=1)
    in_order = [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert (seen != in_order) if shuffle else (seen == in_order), seen


def test_the_update_bounds_a_negative_advantages_loss_by_clip_ratio_c():
    """Every ratio e^2 (7.4) with advantage -1: each token's clipped loss, 7.4, is bounded by the
    dual clip's 3 (actor.clip_ratio_c), as verl computes it."""
    cfg = load_config(None, ["actor.ppo_epochs=1", "actor.mini_batch_size=8", "model.hidden_size=16",
                             "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32"])
    engine = PolicyEngine(cfg.model, 12, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    data = _batch()
    data.batch["old_log_probs"] = engine.compute_log_prob(data).batch["log_probs"] - 2.0
    data.batch["advantages"] = -torch.ones_like(data.batch["advantages"])
    metrics = engine.update(data, step=1)
    assert metrics["actor/pg_loss"] == pytest.approx(3.0) and metrics["actor/pg_clipfrac_lower"] == 1.0
