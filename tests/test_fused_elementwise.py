"""The norms, rotary embedding and SwiGLU of a trained Llama-family model compiled into fused
kernels (resilient_rl/models/fused_elementwise.py): the eager values within float rounding, a few
graphs per process whatever the token count, fewer activation bytes kept for the backward, other
models of the class left as they are, and the engines' switch (``<role>.compile_elementwise``) with
its eager fallback."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from resilient_rl.models import fused_elementwise
from resilient_rl.models.fused_elementwise import compile_elementwise, compiles_elementwise
from resilient_rl.models.hf import load_hf_causal_lm, tiny_llama_config
from resilient_rl.models.precision import hand_on_in_autocast_dtype

QWEN2 = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 256, "tie_word_embeddings": True}
CONFIGS = {"qwen2": QWEN2, "llama": tiny_llama_config(128, hidden_size=64, num_heads=4, intermediate_size=128)}


def _ids(rows: int, tokens: int) -> torch.Tensor:
    return torch.randint(0, 128, (rows, tokens), generator=torch.Generator().manual_seed(rows))


def _model(name: str, fused: bool):
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config=CONFIGS[name])
    hand_on_in_autocast_dtype(model)  # as a replica under autocast is hooked
    if fused:
        layers = CONFIGS[name]["num_hidden_layers"]
        # two norms a layer and the final one; the MLPs; the attention modules (their rotary embedding)
        assert compile_elementwise(model) == 2 * layers + 1 + layers + layers
    return model


def _loss_and_grads(model, ids: torch.Tensor, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, use_cache=False).logits.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_they_compile_on_a_gpu_by_default_and_as_set_anywhere():
    assert compiles_elementwise(None, "cuda:0") and not compiles_elementwise(None, "cpu")
    assert compiles_elementwise(True, torch.device("cpu")) and not compiles_elementwise(False, "cuda")
    assert not compiles_elementwise(True, "cpu", blocks=True) and not compiles_elementwise(None, "cuda", blocks=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_compiled_norms_rotary_and_swiglu_give_the_eager_loss_and_gradients_in_one_graph_each(name):
    """Under bf16 autocast (the replica on a GPU) and in fp32, over batches of other sizes: the
    eager module's loss and gradients within rounding, one graph per function and autocast state
    (the token count is a symbol), no graph break."""
    eager, fused = _model(name, False), _model(name, True)
    torch._dynamo.reset()
    counters.clear()
    for ids in (_ids(2, 48), _ids(3, 30), _ids(1, 57)):
        for autocast in (True, False):
            want, got = _loss_and_grads(eager, ids, autocast), _loss_and_grads(fused, ids, autocast)
            rtol, atol = (2e-2, 2e-3) if autocast else (1e-5, 1e-6)
            torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
            for n, g in want[1].items():
                torch.testing.assert_close(got[1][n], g, rtol=10 * rtol, atol=atol, msg=n)
    # rms_norm, rotary and silu_mul, each with autocast on and off; a one-row batch is no new graph
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_rotary_embedding_is_hugging_faces(dtype):
    """Query and key as the projections lay them out (and one that is not), ``cos``/``sin`` per row
    or shared by the rows: the values and gradients of the module's own function."""
    from transformers.models.qwen2 import modeling_qwen2

    compile_elementwise(_model("qwen2", False))  # installs the module's dispatcher
    own = modeling_qwen2.apply_rotary_pos_emb.rrl_original
    gen = torch.Generator().manual_seed(0)
    for rows, tokens, cos_rows, laid_out in ((2, 7, 2, True), (3, 5, 1, True), (1, 9, 1, False)):
        def qk(heads: int) -> torch.Tensor:
            if laid_out:  # [rows, heads, tokens, dim] as a view of the projection's [rows, tokens, heads * dim]
                return torch.randn(rows, tokens, heads * 8, generator=gen).view(rows, tokens, heads, 8).transpose(1, 2)
            return torch.randn(rows, heads, tokens, 8, generator=gen)

        q, k = qk(4).to(dtype), qk(2).to(dtype)
        angles = torch.rand(cos_rows, tokens, 4, generator=gen) * 6
        cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
        grads = [torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)]
        outs = []
        for fn in (own, fused_elementwise._compiled_rotary):
            a, b = q.detach().requires_grad_(), k.detach().requires_grad_()
            got = fn(a, b, cos, sin)
            torch.autograd.backward(got, grads)
            outs.append((*got, a.grad, b.grad))
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        for got, want in zip(outs[1], outs[0]):
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got, want, **tol)


def test_other_models_of_the_class_and_compiled_code_use_the_modules_own_rotary(monkeypatch):
    """The dispatcher the class's modeling module now holds runs the compiled rotary embedding only
    inside an attention of a model :func:`compile_elementwise` replaced: a rollout model of the same
    class in the process computes with the module's own function, and its compiled decode step
    traces that function (no graph break) and samples what it samples eagerly."""
    from resilient_rl.models.engine import generate_static

    calls = []
    compiled_rotary = fused_elementwise._compiled_rotary
    monkeypatch.setattr(fused_elementwise, "_compiled_rotary", lambda *a: calls.append(1) or compiled_rotary(*a))
    fused, rollout = _model("qwen2", True), _model("qwen2", False).eval()
    ids = _ids(2, 12)
    rollout(input_ids=ids, use_cache=False)
    assert not calls
    fused(input_ids=ids, use_cache=False)
    assert len(calls) == QWEN2["num_hidden_layers"]
    mask = torch.ones_like(ids)
    runs = [generate_static(rollout, ids, mask, max_new_tokens=6, compile=compile,
                            generator=torch.Generator().manual_seed(1)) for compile in (True, False)]
    assert runs[0].engine_stats["compiled"] and runs[0].engine_stats["graph_breaks"] == 0, runs[0].engine_stats
    assert torch.equal(runs[0].responses, runs[1].responses)
    assert len(calls) == QWEN2["num_hidden_layers"]


def test_checkpointed_blocks_recompute_through_the_compiled_functions():
    """Activation checkpointing runs a block's forward again in the backward, through the compiled
    norms, rotary embedding and SwiGLU: the gradients of the model without checkpointing."""
    from resilient_rl.workers.block_options import apply_block_options, checkpointed_blocks

    plain, checkpointed = _model("qwen2", True), _model("qwen2", True)
    apply_block_options(checkpointed, activation_checkpointing=True)
    assert checkpointed_blocks(checkpointed) == QWEN2["num_hidden_layers"]
    ids = _ids(2, 20)
    want, got = _loss_and_grads(plain, ids, True), _loss_and_grads(checkpointed, ids, True)
    torch.testing.assert_close(got[0], want[0])
    for n, g in want[1].items():
        torch.testing.assert_close(got[1][n], g, msg=n)


def test_the_norms_hand_on_autocasts_dtype_and_keep_their_dtype_outside_it():
    model = _model("qwen2", True)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(1, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == torch.bfloat16
    assert norm(x).dtype == torch.float32
    assert norm(x.bfloat16()).dtype == torch.float32  # fp32 weight times a bf16 input, as the module's own


def test_autograd_keeps_fewer_activation_bytes_for_the_backward():
    """The compiled norm keeps its input and one fp32 scale a token, not its upcast and normalised
    copies; the SwiGLU its two inputs, not also ``silu(gate)``."""
    ids = _ids(2, 48)

    def kept(model) -> int:
        storages = {}

        def pack(t):
            if ids.shape[1] in t.shape:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model.model(input_ids=ids, use_cache=False)
        return sum(storages.values())

    eager, fused = kept(_model("qwen2", False)), kept(_model("qwen2", True))
    assert fused < 0.75 * eager, (fused, eager)


def _engine_config(**keys):
    from resilient_rl.config.schema import config_from_dict

    return config_from_dict({"model": {"kind": "hf", "hf_config": QWEN2},
                             "actor": {"ppo_epochs": 1, "mini_batch_size": 2, **keys.get("actor", {})},
                             "critic": {"ppo_epochs": 1, "mini_batch_size": 2, **keys.get("critic", {})}})


def _data():
    from resilient_rl.protocol import DataProto

    ids = _ids(2, 12)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                                "responses": ids[:, 6:], "response_mask": torch.ones(2, 6)})


def test_the_engines_compile_them_when_set_and_report_whether_they_stayed_compiled():
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine
    from resilient_rl.workers.value import ValueEngine

    cfg = _engine_config(actor={"compile_elementwise": True}, critic={"compile_elementwise": True})
    plan = plan_device("cpu")
    actor = PolicyEngine(cfg.model, 128, 0, plan, actor_cfg=cfg.actor, total_steps=1)
    ref = PolicyEngine(cfg.model, 128, 0, plan, trainable=False, compile_elementwise=True)
    critic = ValueEngine(cfg.model, cfg.critic, 128, 1, plan, total_steps=1)
    plain = PolicyEngine(cfg.model, 128, 0, plan, trainable=False)
    assert actor.compile_elementwise and ref.compile_elementwise and critic.compile_elementwise
    assert not plain.compile_elementwise  # null on a CPU
    assert type(ref.model.model.norm).forward is not ref.model.model.norm.forward.__func__
    data = _data()
    logp = actor.compute_log_prob(data).batch["log_probs"]
    torch.testing.assert_close(ref.compute_log_prob(data).batch["log_probs"], logp)
    torch.testing.assert_close(plain.compute_log_prob(data).batch["log_probs"], logp, rtol=1e-5, atol=1e-5)
    data.batch["old_log_probs"], data.batch["advantages"] = logp, torch.randn(2, 6)
    data.batch["values"] = critic.compute_values(data).batch["values"]
    data.batch["returns"] = torch.randn(2, 6)
    data.meta_info["seed"] = 0
    assert actor.update(data, step=1)["perf/actor_elementwise_eager"] == 0.0
    assert critic.update(data, step=1)["perf/critic_elementwise_eager"] == 0.0


def test_compiled_blocks_hold_them_already():
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    cfg = _engine_config(actor={"compile_elementwise": True, "compile": True})
    assert not PolicyEngine(cfg.model, 128, 0, plan_device("cpu"), actor_cfg=cfg.actor).compile_elementwise


def test_a_compiler_failure_leaves_them_eager_with_one_warning_and_a_metric(monkeypatch, caplog):
    """A compiler error at the first call costs no step: the process runs the same arithmetic
    eagerly from then on, warns once, and the update reports perf/actor_elementwise_eager 1."""
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    calls = []

    def failing(*args):
        calls.append(1)
        raise torch._dynamo.exc.InternalTorchDynamoError("inductor: no kernel for this device")

    monkeypatch.setitem(fused_elementwise.ELEMENTWISE_FAILURE, "reason", None)
    monkeypatch.setattr(fused_elementwise, "_compiled", lambda fn: failing)
    cfg = _engine_config(actor={"compile_elementwise": True})
    actor = PolicyEngine(cfg.model, 128, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    plain = PolicyEngine(cfg.model, 128, 0, plan_device("cpu"), trainable=False)
    data = _data()
    with caplog.at_level("WARNING", logger="resilient_rl.models.fused_elementwise"):
        got = actor.compute_log_prob(data)
        data.batch["old_log_probs"], data.batch["advantages"] = got.batch["log_probs"], torch.randn(2, 6)
        data.meta_info["seed"] = 0
        metrics = actor.update(data, step=1)
    assert torch.equal(got.batch["log_probs"], plain.compute_log_prob(data).batch["log_probs"])
    assert len(calls) == 1 and metrics["perf/actor_elementwise_eager"] == 1.0
    warned = [r for r in caplog.records if "compiled norms, rotary embedding and SwiGLU failed" in r.message]
    assert len(warned) == 1 and "InternalTorchDynamoError: inductor: no kernel for this device" in warned[0].message


def test_out_of_memory_in_a_compiled_norm_is_raised_not_taken_for_a_compiler_failure(monkeypatch):
    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setitem(fused_elementwise.ELEMENTWISE_FAILURE, "reason", None)
    monkeypatch.setattr(fused_elementwise, "_compiled", lambda fn: oom)
    model = _model("qwen2", True)
    with pytest.raises(torch.OutOfMemoryError):
        model(input_ids=_ids(1, 8), use_cache=False)
    assert fused_elementwise.ELEMENTWISE_FAILURE["reason"] is None
