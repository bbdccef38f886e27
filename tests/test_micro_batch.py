"""Token-sized micro-batches (workers/micro_batch.py, ``actor.micro_batch_tokens``) and the block
options (``actor.activation_checkpointing``, ``actor.compile``): same gradients and log-probs as
one forward per mini-batch, within float tolerance."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.config.schema import config_from_dict
from resilient_rl.errors import ConfigError
from resilient_rl.protocol import DataProto
from resilient_rl.workers import micro_batch
from resilient_rl.workers.block_options import checkpointed_blocks
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine

VOCAB = 20
PROMPT, RESP = 8, 5


def _cfg(**actor):
    return config_from_dict({"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                                       "max_seq_len": 16},
                             "actor": {"mini_batch_size": 8, "ppo_epochs": 1, **actor}})


def _batch(rows: int = 8) -> DataProto:
    """Left-padded prompts of varied lengths and right-padded responses of varied lengths."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (rows, PROMPT + RESP), generator=g)
    mask = torch.ones_like(ids)
    resp_mask = torch.ones(rows, RESP)
    for r in range(rows):
        mask[r, :(r * 3) % 7] = 0       # up to 6 pad columns on the left
        cut = RESP - (r % 3)            # up to 2 pad tokens after the response
        mask[r, PROMPT + cut:] = 0
        resp_mask[r, cut:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                "responses": ids[:, PROMPT:], "response_mask": resp_mask,
                                "old_log_probs": -2.5 + 0.1 * torch.randn(rows, RESP, generator=g),
                                "ref_log_prob": -2.6 + 0.1 * torch.randn(rows, RESP, generator=g),
                                "advantages": torch.randn(rows, RESP, generator=g)}, meta_info={"seed": 1})


def test_ranges_respect_the_token_budget_and_trimming_drops_shared_left_padding():
    mask = _batch().batch["attention_mask"]
    lengths = micro_batch.row_lengths(mask)
    assert lengths.tolist() == [13 - (r * 3) % 7 for r in range(8)]
    ranges = micro_batch.micro_batches(mask, 24)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all((e - s) * int(lengths[s:e].max()) <= 24 or e - s == 1 for s, e in ranges)
    assert len(ranges) > 1
    assert micro_batch.micro_batches(mask, None) == [(0, 8)]
    assert micro_batch.micro_batches(mask, 1) == [(r, r + 1) for r in range(8)]  # a long row goes alone
    rows = {k: v[2:4] for k, v in _batch().batch.items()}  # 6 and 2 pad columns: 2 are shared
    trimmed = micro_batch.trim_left_padding(rows)
    assert trimmed["input_ids"].shape[1] == PROMPT + RESP - 2
    assert torch.equal(trimmed["responses"], rows["responses"])
    assert torch.equal(trimmed["input_ids"], rows["input_ids"][:, 2:])


def test_config_rejects_a_non_positive_budget():
    assert _cfg().actor.micro_batch_tokens == "auto"
    with pytest.raises(ConfigError, match="actor.micro_batch_tokens"):
        _cfg(micro_batch_tokens=0)
    with pytest.raises(ConfigError, match="actor.activation_checkpointing"):
        _cfg(activation_checkpointing="maybe")


def _update(cfg, batch: DataProto):
    """One update: (engine, log-probs before it, its metrics, the weights after it); the gradients
    the optimizer stepped with are kept as ``engine.stepped_grads``."""
    engine = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu"), actor_cfg=cfg.actor)
    lp = engine.compute_log_prob(batch).batch["log_probs"]
    engine.optimizer.register_step_pre_hook(lambda *_: setattr(
        engine, "stepped_grads", {n: p.grad.clone() for n, p in engine.model.named_parameters()}))
    metrics = engine.update(batch, step=0)
    return engine, lp, metrics, {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_token_micro_batches_give_the_row_batch_update(agg):
    opts = dict(loss_agg_mode=agg, use_kl_loss=True, entropy_coeff=0.01)
    batch = _batch()
    mask = batch.batch["response_mask"]
    rows, lp_rows, m_rows, w_rows = _update(_cfg(**opts), batch)
    tok, lp_tok, m_tok, w_tok = _update(_cfg(micro_batch_tokens=30, **opts), batch)
    assert torch.allclose(lp_tok * mask, lp_rows * mask, atol=1e-5)
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert m_tok[k] == pytest.approx(m_rows[k], rel=1e-4, abs=1e-6), k
    for n in w_rows:  # the gradients stepped with; Adam's first step is about lr * sign(g), except
        # where |g| is near its eps (1e-8), where float rounding of g moves it by a part of lr
        assert torch.allclose(tok.stepped_grads[n], rows.stepped_grads[n], rtol=1e-5, atol=1e-8), n
        assert torch.allclose(w_tok[n], w_rows[n], atol=0.01 * rows.optimizer.param_groups[0]["lr"]), n


def test_activation_checkpointing_keeps_names_and_the_update():
    batch = _batch()
    plain, lp0, m0, w0 = _update(_cfg(), batch)
    ckpt, lp1, m1, w1 = _update(_cfg(activation_checkpointing=True), batch)
    assert checkpointed_blocks(ckpt.model) == 2 and checkpointed_blocks(plain.model) == 0
    assert list(w0) == list(w1)  # parameter names, hence checkpoints and weight sync, unchanged
    assert torch.equal(lp0, lp1)
    for n in w0:
        assert torch.allclose(w1[n], w0[n], atol=1e-7), n


def test_activation_checkpointing_frees_block_activations():
    """With checkpointing, the graph keeps far fewer saved tensors during the update's forward."""
    def saved(cfg) -> int:
        engine = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu"), actor_cfg=cfg.actor)
        engine.model.train(True)
        count = [0]

        def pack(t):
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = engine._logprobs(dict(_batch().batch.items()))
        logp.sum().backward()
        return count[0]

    assert saved(_cfg(activation_checkpointing=True)) < saved(_cfg()) / 2


def _compile_matches_eager():
    batch = _batch()
    _, lp0, m0, w0 = _update(_cfg(), batch)
    _, lp1, m1, w1 = _update(_cfg(compile=True, micro_batch_tokens=40), batch)
    assert torch.allclose(lp1, lp0, atol=1e-5)
    for n in w0:
        assert torch.allclose(w1[n], w0[n], atol=1e-5), n


def test_compile_traces_the_blocks_and_matches_eager(monkeypatch):
    """``actor.compile`` through TorchDynamo and AOTAutograd (forward and backward graphs, dynamic
    shapes from token micro-batches), with the ``aot_eager`` backend: the code generation of the
    default backend (inductor) takes minutes on this CPU; the slow test below runs it."""
    compile_module = torch.nn.Module.compile
    calls = []

    def with_aot_eager(self, *args, **kwargs):
        calls.append(kwargs)
        return compile_module(self, *args, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", with_aot_eager)
    torch._dynamo.reset()
    _compile_matches_eager()
    assert len(calls) == 2 and all(c.get("dynamic") for c in calls)


@pytest.mark.slow
def test_compile_with_inductor_runs_and_matches_eager():
    torch._dynamo.reset()
    _compile_matches_eager()


def test_critic_token_micro_batches_and_checkpointing_give_the_row_batch_update():
    from resilient_rl.workers.value import ValueEngine

    batch = _batch()
    batch.batch["values"] = 0.1 * batch.batch["advantages"]
    batch.batch["returns"] = batch.batch["advantages"]

    def run(**critic):
        cfg = config_from_dict({"model": {"hidden_size": 32, "num_layers": 2,
                                                                      "num_heads": 2, "intermediate_size": 64,
                                                                      "max_seq_len": 16},
                                "critic": {"mini_batch_size": 8, "ppo_epochs": 1, **critic}})
        engine = ValueEngine(cfg.model, cfg.critic, VOCAB, 0, plan_device("cpu"))
        values = engine.compute_values(batch).batch["values"]
        metrics = engine.update(batch, step=0)
        return engine, values, metrics, {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    _, v0, m0, w0 = run()
    engine, v1, m1, w1 = run(micro_batch_tokens=30, activation_checkpointing=True)
    assert checkpointed_blocks(engine.model) == 2
    assert torch.allclose(v1, v0, atol=1e-5)
    for k in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    for n in w0:
        assert torch.allclose(w1[n], w0[n], atol=1e-6), n


def test_packed_micro_batches_count_real_tokens_and_give_the_row_batch_update():
    mask = _batch().batch["attention_mask"]
    real = mask.sum(dim=1)
    ranges = micro_batch.micro_batches(mask, 24, packed=True)
    assert all(int(real[s:e].sum()) <= 24 or e - s == 1 for s, e in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and ranges[-1][1] == 8
    opts = dict(use_kl_loss=True, entropy_coeff=0.01)
    batch = _batch()
    resp = batch.batch["response_mask"]
    _, lp_rows, m_rows, w_rows = _update(_cfg(**opts), batch)
    for extra in ({"packing": True}, {"packing": True, "micro_batch_tokens": 30}):
        _, lp, m, w = _update(_cfg(**opts, **extra), batch)
        assert torch.allclose(lp * resp, lp_rows * resp, atol=1e-5), extra
        for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert m[k] == pytest.approx(m_rows[k], rel=1e-4, abs=1e-6), (k, extra)
        for n in w_rows:
            assert torch.allclose(w[n], w_rows[n], atol=1e-6), (n, extra)


def test_the_ref_packs_its_rows_as_the_actor_does(monkeypatch):
    """``actor.packing`` packs the ref's log-prob pass too: the same log-probs as its padded pass,
    through packed attention."""
    from resilient_rl.models import varlen

    cfg = _cfg(packing=True)
    batch = _batch()
    resp = batch.batch["response_mask"]
    padded = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu"), trainable=False)
    packed = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu"), trainable=False, packing=cfg.actor.packing)
    assert (padded.packing, packed.packing) == (False, True)
    calls = []
    real = varlen.varlen_attention
    monkeypatch.setattr("resilient_rl.models.tiny.varlen_attention",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    lp_packed = packed.compute_log_prob(batch).batch["log_probs"]
    assert calls and len(calls[0].lengths) == len(batch)  # one packed row of the 8 sequences
    lp_padded = padded.compute_log_prob(batch).batch["log_probs"]
    assert torch.allclose(lp_packed * resp, lp_padded * resp, atol=1e-5)


def test_the_single_process_roles_hand_the_ref_the_actors_packing_and_head_compile(tmp_path):
    from resilient_rl.config.schema import load_config
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    for value in (False, True, None):
        setting = "null" if value is None else str(value).lower()
        cfg = load_config(None, [f"actor.packing={str(bool(value)).lower()}", f"actor.compile_head={setting}",
                                 "trainer.total_steps=1", "data.batch_size=4", "actor.mini_batch_size=4",
                                 "critic.mini_batch_size=4", "trainer.progress_bar=false",
                                 f"trainer.output_dir={tmp_path}", f"checkpoint.root={tmp_path}/ckpt"])
        roles = LocalRoles(cfg, PPOTrainer(cfg).tokenizer)
        assert roles.ref.packing is roles.actor.packing is bool(value)
        assert roles.ref.compile_head is roles.actor.compile_head is bool(value)  # null: on GPU only


def test_compiled_blocks_compile_once_per_grad_mode_across_packed_layouts(monkeypatch):
    """``actor.compile`` with packed rows (a Qwen2 model, as the GPU workloads run it): micro-batches
    of other lengths and other sequence layouts reuse the compiled frames, one set for the no-grad
    passes and one for the update's; the only graph breaks are at the packed attention, which runs
    outside the graph. (aot_eager: what dynamo traces and guards is the same as inductor's.)"""
    from torch._dynamo.utils import counters

    from resilient_rl.models.hf import load_hf_causal_lm
    from resilient_rl.workers.block_options import apply_block_options
    from resilient_rl.workers.logprob import response_logprobs

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *a, **k: compile_module(self, *a, **{**k, "backend": "aot_eager"}))
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config={
        "model_type": "qwen2", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
        "tie_word_embeddings": True})
    apply_block_options(model, compile=True)
    torch._dynamo.reset()
    counters.clear()
    frames = []
    for i, (rows, prompt, resp) in enumerate([(4, 16, 24), (5, 20, 30), (3, 12, 40), (6, 16, 16)]):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, 300, (rows, prompt + resp), generator=g)
        mask = torch.ones_like(ids)
        for r in range(rows):  # left padding and early ends of varied length
            mask[r, :int(torch.randint(0, prompt // 2, (), generator=g))] = 0
            mask[r, prompt + int(torch.randint(1, resp, (), generator=g)):] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                 "responses": ids[:, prompt:]}
        with torch.no_grad():
            response_logprobs(model, batch, torch.device("cpu"), pack=True)
        logp, ent = response_logprobs(model, batch, torch.device("cpu"), pack=True)
        (logp.sum() + ent.sum()).backward()
        frames.append(counters["stats"]["unique_graphs"])
    assert frames[0] > 0 and frames == [frames[0]] * len(frames), frames
    breaks = " ".join(counters["graph_break"])
    assert "_attention" in breaks and all("disable" in reason for reason in counters["graph_break"]), breaks
