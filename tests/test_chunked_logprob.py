"""Chosen-token log-probs without full-vocabulary logits (workers/logprob.py): the same values as
the full-logits path, gradients within float tolerance, and no ``[B, R, V]`` tensor in the graph."""

from __future__ import annotations

import warnings

import pytest
import torch

from resilient_rl.models.hf import load_hf_causal_lm, tiny_llama_config
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.workers.logprob import (compiles_head, full_response_logprobs, packed_inputs, response_logprobs,
                                         supports_chunked_head)

CPU = torch.device("cpu")
B, P, R = 5, 7, 6


def _qwen2(vocab: int) -> dict:
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "max_position_embeddings": 64, "tie_word_embeddings": True}


def _models():
    torch.manual_seed(0)
    return {"tiny": TinyCausalLM(TinyLMConfig(vocab_size=50, hidden_size=32, num_heads=2)),
            "llama": load_hf_causal_lm(hf_config=tiny_llama_config(300, hidden_size=32, num_heads=2)),
            "qwen2": load_hf_causal_lm(hf_config=_qwen2(200))}


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:]}


@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2"])
def test_chunked_equals_full_logits_and_gradients_within_tolerance(name):
    model = _models()[name]
    assert supports_chunked_head(model)
    vocab = model.get_output_embeddings().out_features
    batch = _batch(vocab)
    with torch.no_grad():
        full = full_response_logprobs(model, batch, CPU)
        for chunk in (vocab * 4, vocab * 7, 1 << 26):  # several chunks (one uneven), one chunk
            got = response_logprobs(model, batch, CPU, chunk_elements=chunk)
            # The head's product over a chunk's rows may be blocked otherwise than over all rows.
            for a, b in zip(got, full):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"chunk of {chunk} elements")
            again = response_logprobs(model, batch, CPU, chunk_elements=chunk)
            assert all(torch.equal(a, b) for a, b in zip(got, again)), f"chunk of {chunk}: not reproducible"

    def grads(fn, **kw):
        model.zero_grad(set_to_none=True)
        logp, ent = fn(model, batch, CPU, **kw)
        (logp.sum() + 0.3 * ent.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(full_response_logprobs), grads(response_logprobs, chunk_elements=vocab * 4)
    assert want.keys() == got.keys() and want
    for n in want:  # the weight gradient is summed chunk by chunk: same terms, another order
        assert torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-6), n


def _largest_saved(fn, model, batch) -> int:
    """The largest vocabulary-wide activation the autograd graph keeps for the backward pass
    (recomputation inside the backward holds one chunk at a time and is not counted)."""
    vocab = model.get_output_embeddings().out_features
    params = {p.data_ptr() for p in model.parameters()}
    sizes = [0]

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == vocab and t.data_ptr() not in params:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = fn(model, batch, CPU)
    (logp.sum() + ent.sum()).backward()
    return max(sizes)


def test_graph_holds_no_full_vocabulary_logits():
    model = _models()["llama"]
    vocab = model.get_output_embeddings().out_features
    batch = _batch(vocab)
    logits_size = B * R * vocab
    assert _largest_saved(full_response_logprobs, model, batch) >= logits_size  # the old path keeps them
    assert _largest_saved(lambda m, b, d: response_logprobs(m, b, d, chunk_elements=vocab * 8), model, batch) == 0


def test_models_that_transform_logits_take_the_full_path():
    model = load_hf_causal_lm(hf_config={**tiny_llama_config(64), "model_type": "llama"})
    model.config.final_logit_softcapping = 30.0
    assert not supports_chunked_head(model)
    batch = _batch(64)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(response_logprobs(model, batch, CPU),
                                                      full_response_logprobs(model, batch, CPU)))


@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2"])
def test_packed_rows_give_the_padded_rows_log_probs(name):
    """All real tokens of the batch in one row, no mask: each sequence sees only itself."""
    model = _models()[name]
    batch = _batch(model.get_output_embeddings().out_features)
    mask = batch["attention_mask"]
    mask[2, P + 3:] = 0  # responses that ended early: padding after them
    mask[3, P + 1:] = 0
    valid = mask[:, P:].bool()
    with torch.no_grad():
        padded = response_logprobs(model, batch, CPU)
        packed = response_logprobs(model, batch, CPU, pack=True)
    for a, b in zip(padded, packed):
        assert torch.allclose(a[valid], b[valid], atol=1e-5)
        assert torch.equal(b[~valid], torch.zeros_like(b[~valid]))
    # Without the packing, the same row of tokens attends across sequences: the values differ.
    inputs, _ = packed_inputs(batch, CPU)
    with torch.no_grad():
        crossing = model(input_ids=inputs["input_ids"], attention_mask=torch.ones_like(inputs["input_ids"]),
                         position_ids=inputs["position_ids"], use_cache=False).logits
        # (Hugging Face models detect packed rows only without a cache, hence use_cache=False.)
        separate = model(**inputs, use_cache=False).logits
    assert (crossing - separate).abs().max() > 1e-5  # the tolerance the equality above uses


@pytest.mark.parametrize("pack", [False, True])
def test_an_fsdp2_model_returns_no_view_through_the_chunked_head(single_rank_group, pack):
    """FSDP2 registers its pre-backward hook on the root module's outputs and warns when one is a
    view (an in-place op on it would drop the hook): the chunked head's statistics are a tensor of
    their own, and the warning, once per worker process, stays out of the workers' logs."""
    from torch.distributed.fsdp import fully_shard

    model = _models()["tiny"]
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    batch = _batch(model.get_output_embeddings().out_features)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*returned a view tensor")
        logp, ent = response_logprobs(model, batch, CPU, chunk_elements=50 * 4, pack=pack)
    (logp.sum() + ent.sum()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_head_compiles_on_a_gpu_by_default_and_as_set_anywhere():
    assert compiles_head(None, "cuda:0") and not compiles_head(None, CPU)
    assert compiles_head(True, "cpu") and not compiles_head(False, torch.device("cuda"))


@pytest.mark.parametrize("pack", [False, True])
def test_the_compiled_head_gives_the_eager_values_and_gradients_compiling_two_graphs(pack):
    """The compiled reductions (actor.compile_head) equal the eager ones within float rounding, in
    the no-grad pass and in the update's forward and backward (chunks recomputed in the backward),
    and compile one graph for the statistics and one for their gradient: the chunks' rows are a
    symbol, so neither the uneven last chunk nor a batch of other lengths compiles again, and
    nothing breaks the graph."""
    from torch._dynamo.utils import counters

    model = _models()["qwen2"]
    vocab = model.get_output_embeddings().out_features
    torch._dynamo.reset()
    counters.clear()
    shorter = {k: v[:3, 2:] if k != "responses" else v[:3] for k, v in _batch(vocab).items()}
    for batch in (_batch(vocab), shorter):
        kw = dict(chunk_elements=vocab * 4, pack=pack)  # several chunks, the last one uneven
        with torch.no_grad():
            for a, b in zip(response_logprobs(model, batch, CPU, compile_head=True, **kw),
                            response_logprobs(model, batch, CPU, **kw)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

        def grads(**extra):
            model.zero_grad(set_to_none=True)
            logp, ent = response_logprobs(model, batch, CPU, **kw, **extra)
            (logp.sum() + 0.3 * ent.sum()).backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        want, got = grads(), grads(compile_head=True)
        assert want.keys() == got.keys() and want
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # statistics; their gradient
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_policy_engine_runs_its_passes_through_the_compiled_head_when_set():
    """actor.compile_head reaches the actor's log-prob pass and its update, and the ref's pass; a
    process that holds both (the colocated placement) compiles two graphs, not three."""
    from torch._dynamo.utils import counters

    from resilient_rl.config.schema import load_config
    from resilient_rl.protocol import DataProto
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    cfg = load_config(None, ["actor.compile_head=true", "actor.ppo_epochs=1", "actor.mini_batch_size=4",
                             "model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
                             "model.intermediate_size=32"])
    actor = PolicyEngine(cfg.model, 50, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    ref = PolicyEngine(cfg.model, 50, 0, plan_device("cpu"), trainable=False, compile_head=cfg.actor.compile_head)
    assert actor.compile_head and ref.compile_head
    data = DataProto.from_dict({**{k: v[:4] for k, v in _batch(50).items()}, "response_mask": torch.ones(4, R)})
    torch._dynamo.reset()
    counters.clear()
    logp = actor.compute_log_prob(data).batch["log_probs"]
    torch.testing.assert_close(ref.compute_log_prob(data).batch["log_probs"], logp)  # the same initial weights
    assert counters["stats"]["unique_graphs"] == 1  # the ref's frozen weights share the actor's no-grad graph
    data.batch["old_log_probs"], data.batch["advantages"] = logp, torch.randn(4, R)
    data.meta_info["seed"] = 0
    assert torch.isfinite(torch.tensor(actor.update(data, step=1)["actor/grad_norm"]))
    assert counters["stats"]["unique_graphs"] == 2  # the update's gradient; its forward is the no-grad graph


def test_a_compiler_failure_leaves_the_head_eager_with_one_warning_and_a_metric(monkeypatch, caplog):
    """The compiled head failing (a compiler error at its first call) costs no step: this process
    computes the chunk eagerly from then on, warns once, and the update reports perf/head_eager."""
    from resilient_rl.config.schema import load_config
    from resilient_rl.protocol import DataProto
    from resilient_rl.workers import chunked_head
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    calls = []

    def failing(*args):
        calls.append(1)
        raise torch._dynamo.exc.InternalTorchDynamoError("inductor: no kernel for this device")

    monkeypatch.setitem(chunked_head.HEAD_FAILURE, "reason", None)
    monkeypatch.setattr(chunked_head, "_compiled", lambda fn: failing)
    cfg = load_config(None, ["actor.compile_head=true", "actor.ppo_epochs=1", "actor.mini_batch_size=4",
                             "model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
                             "model.intermediate_size=32"])
    actor = PolicyEngine(cfg.model, 50, 0, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=1)
    data = DataProto.from_dict({**{k: v[:4] for k, v in _batch(50).items()}, "response_mask": torch.ones(4, R)})
    eager = PolicyEngine(cfg.model, 50, 0, plan_device("cpu"), trainable=False).compute_log_prob(data)
    with caplog.at_level("WARNING", logger="resilient_rl.workers.chunked_head"):
        got = actor.compute_log_prob(data)
        data.batch["old_log_probs"], data.batch["advantages"] = got.batch["log_probs"], torch.randn(4, R)
        data.meta_info["seed"] = 0
        metrics = actor.update(data, step=1)
    assert torch.equal(got.batch["log_probs"], eager.batch["log_probs"])
    assert len(calls) == 1 and metrics["perf/head_eager"] == 1.0
    warnings_ = [r for r in caplog.records if "compiled reductions failed" in r.message]
    assert len(warnings_) == 1 and "InternalTorchDynamoError: inductor: no kernel for this device" in warnings_[0].message


def test_out_of_memory_in_the_compiled_head_is_raised_not_taken_for_a_compiler_failure(monkeypatch):
    from resilient_rl.workers import chunked_head

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setitem(chunked_head.HEAD_FAILURE, "reason", None)
    monkeypatch.setattr(chunked_head, "_compiled", lambda fn: oom)
    with pytest.raises(torch.OutOfMemoryError):
        chunked_head._run(chunked_head.fused_logit_stats, chunked_head.logit_stats, True, torch.zeros(2, 3),
                          torch.zeros(2, dtype=torch.long))
    assert chunked_head.HEAD_FAILURE["reason"] is None


def test_the_compiled_heads_gradient_is_elementwise_with_no_scatter():
    """The graphs the compiler gets: the chosen logit is a masked sum and its gradient a masked
    term, so both fuse with the softmax's passes; a gather's gradient would scatter into a zeroed
    [rows, vocab] tensor (atomic adds on a GPU). The chosen log-prob equals the gather's exactly,
    and the closed-form gradient (one pass over the logits, given the forward's values) equals
    autograd's through the reference arithmetic."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    from resilient_rl.workers.chunked_head import _row_terms, fused_logit_stats, logit_grad, logit_stats

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 20, (6,), generator=g)
    upstream = torch.randn(6, 2, generator=g, dtype=torch.float64)
    stats = torch.compile(fused_logit_stats, backend=backend, dynamic=True)(logits, labels)
    grad = torch.compile(logit_grad, backend=backend, dynamic=True)(logits, labels, upstream,
                                                                     *_row_terms(logits, labels, stats))
    assert len(graphs) == 2  # the statistics, the gradient: neither has a backward graph
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert not [op for op in ops if "scatter" in op or "gather" in op or "index" in op], ops
    # The gradient is one pass over the logits: no reduction along the vocabulary.
    assert not [op for op in (str(n.target) for n in graphs[1].graph.nodes) if "sum" in op or "max" in op], ops
    z = logits - logits.amax(-1, keepdim=True)
    assert torch.equal(stats[:, 0], z.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(z, -1))
    leaf = logits.clone().requires_grad_(True)
    want, = torch.autograd.grad(logit_stats(leaf, labels), leaf, upstream)
    torch.testing.assert_close(stats, logit_stats(logits, labels))
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunks", [3, 40])
def test_mixed_precision_casts_the_head_weight_once_a_pass_and_sums_its_gradient_in_fp32(chunks):
    """Under bf16 autocast with the fp32 weight of a replica, the update's head casts the weight to
    bf16 once in its forward and once in its backward, however many chunks; the chunks' weight
    gradients are summed into one fp32 tensor, which autograd receives once (no bf16 gradient, no
    fp32 copy of one per chunk). The statistics equal autocast's per-chunk F.linear's exactly; the
    gradients are within bf16 rounding of an fp64 computation, and over many chunks the weight's
    is closer to it than the sum of per-chunk bf16 gradients that autocast's F.linear gives."""
    from resilient_rl.testing.op_writes import writes_of_size
    from resilient_rl.workers.chunked_head import chunked_head_stats, logit_stats

    g = torch.Generator().manual_seed(0)
    rows, vocab, width = 4, 64, 16
    hidden = torch.randn(rows * chunks - 1, width, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, width, generator=g)).requires_grad_(True)
    labels = torch.randint(0, vocab, (hidden.shape[0],), generator=g)
    upstream = torch.randn(hidden.shape[0], 2, generator=g)

    def grads(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        out.backward(upstream)
        return out.detach(), [hidden.grad, weight.grad]

    ops = writes_of_size(lambda: grads(lambda: chunked_head_stats(hidden, weight, None, labels, rows)),
                         weight.numel(), torch.bfloat16)
    assert ops["_to_copy"][0] == 2, ops  # one bf16 copy in the forward, one in the backward
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    stats, got = grads(lambda: chunked_head_stats(hidden, weight, None, labels, rows))
    per_chunk, old = grads(lambda: torch.cat([
        logit_stats(torch.nn.functional.linear(hidden[s:s + rows], weight), labels[s:s + rows])
        for s in range(0, hidden.shape[0], rows)]))
    assert torch.equal(stats, per_chunk)
    exact = [hidden.detach().bfloat16().double().requires_grad_(), weight.detach().bfloat16().double().requires_grad_()]
    logit_stats(exact[0] @ exact[1].t(), labels).backward(upstream.double())
    errors = [[(x.double() - t.grad).abs().max() / t.grad.abs().max() for x, t in zip(xs, exact)] for xs in (got, old)]
    assert max(errors[0]) < 0.02, errors
    if chunks == 40:
        assert errors[0][1] < errors[1][1], errors  # the weight's: one fp32 sum against 40 bf16 terms


@pytest.mark.parametrize("pack", [False, True])
def test_log_probs_and_their_gradients_are_those_the_rollout_sampled_from_at_its_temperature(pack):
    """At the rollout's temperature T the statistics are those of softmax(logits / T), as verl
    computes them; the chunked head divides its inputs (the head's bias too) instead of the logits."""
    model = _models()["qwen2"]
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.randn(head.out_features, generator=torch.Generator().manual_seed(2)))
    batch = _batch(head.out_features)
    valid = batch["attention_mask"][:, P:].bool()

    def reference():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits[:, P - 1:-1].float() / 0.5
        logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
        ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        return logp, ent

    def grads(fn):
        model.zero_grad(set_to_none=True)
        logp, ent = fn()
        ((logp * valid).sum() + 0.3 * (ent * valid).sum()).backward()
        return [(logp, ent), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}]

    (want, want_grads), (got, got_grads) = grads(reference), grads(
        lambda: response_logprobs(model, batch, CPU, chunk_elements=head.out_features * 4, pack=pack, temperature=0.5))
    for a, b in zip(got, want):
        torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
    assert "lm_head.bias" in want_grads and want_grads.keys() == got_grads.keys()
    for n in want_grads:
        assert torch.allclose(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6), n
    with torch.no_grad():  # the full-logits path too
        full = full_response_logprobs(model, batch, CPU, temperature=0.5)
    for a, b in zip(full, want):
        torch.testing.assert_close(a[valid], b[valid].detach(), rtol=1e-5, atol=1e-5)


def test_the_actor_and_the_ref_score_at_the_rollouts_temperature(monkeypatch):
    """In one process and as Ray role workers alike."""
    from resilient_rl.config.schema import config_to_dict, load_config
    from resilient_rl.data.tokenizer import build_tokenizer
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.workers.roles import ActorWorker, RefWorker

    cfg = load_config(None, ["trainer.device=cpu", "rollout.temperature=0.6"])
    roles = LocalRoles(cfg, build_tokenizer(cfg.data))
    assert roles.actor.temperature == roles.ref.temperature == 0.6
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    for worker in (ActorWorker, RefWorker):
        role = worker.__ray_actor_class__(config_to_dict(cfg), 16, 1, 0)
        role.init_model()
        assert role.engine.temperature == 0.6, worker
