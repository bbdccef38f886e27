"""Fused projections of a rollout model (resilient_rl/models/fused_projections.py): one product for
query, key and value and one for the MLP's gate and up, the same results as the model's own
forward, the same parameters for weight syncs, and fewer products in the compiled decode step."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.models.engine import generate_static
from resilient_rl.models.fused_projections import fuse_projections, fused_modules, refuse
from resilient_rl.models.hf import load_hf_causal_lm

from decode_graphs import recorded_decode_graphs

LAYERS = 2


def config(model_type: str = "qwen2") -> dict:
    return {"model_type": model_type, "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 256, "tie_word_embeddings": True}


def pair(model_type: str = "qwen2"):
    """A model and a fused copy with the same weights."""
    torch.manual_seed(0)
    plain = load_hf_causal_lm(hf_config=config(model_type)).eval()
    fused = load_hf_causal_lm(hf_config=config(model_type)).eval()
    fused.load_state_dict(plain.state_dict())
    assert fuse_projections(fused) == 2 * LAYERS
    return plain, fused


def prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (6, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    ids[4, :7], mask[4, :7] = 0, 0
    return ids, mask


def greedy(model, **kw):
    ids, mask = prompts()
    return generate_static(model, ids, mask, max_new_tokens=12, temperature=0.0, **kw).responses


def test_a_model_built_empty_is_fused_without_a_copy_and_a_sync_then_writes_its_fused_weights():
    """``copy=False`` (a rollout built empty): the fused weights are allocated, not copied from
    weights never written; the first sync writes them through the projections' views."""
    from resilient_rl.models.factory import parameters_on_meta
    from resilient_rl.workers.fsdp import materialize

    plain, _ = pair()
    with parameters_on_meta():
        empty = load_hf_causal_lm(hf_config=config())
    empty = materialize(empty, torch.device("cpu")).eval()
    assert fuse_projections(empty, copy=False) == 2 * LAYERS
    for module in fused_modules(empty):
        names = ("q_proj", "k_proj", "v_proj") if hasattr(module, "q_proj") else ("gate_proj", "up_proj")
        linears = [getattr(module, n) for n in names]
        assert module.rrl_fused_weight.shape[0] == sum(lin.out_features for lin in linears)
        assert linears[0].weight.data_ptr() == module.rrl_fused_weight.data_ptr()
    empty.load_state_dict(plain.state_dict())  # what the rollout's load_weights does
    assert refuse(empty) == 0  # the views hold: nothing fused again
    assert torch.equal(greedy(empty), greedy(plain))


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_fused_model_computes_what_the_model_does_with_the_same_parameters(model_type):
    plain, fused = pair(model_type)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert fused.state_dict().keys() == plain.state_dict().keys()  # the fused weights are not saved
    ids, mask = prompts()
    with torch.no_grad():  # Hugging Face's own forward (its attention unfused, the MLP fused)
        torch.testing.assert_close(fused(input_ids=ids, attention_mask=mask).logits,
                                   plain(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy(fused), greedy(plain))  # the engine's calls: attention fused too
    attention = fused.model.layers[0].self_attn
    assert attention.q_proj.weight.data_ptr() == attention.rrl_fused_weight.data_ptr()
    assert isinstance(attention, type(plain.model.layers[0].self_attn))  # the model's class, fused


def test_weight_syncs_write_the_fused_weight_through_the_parameters():
    """The syncs copy into the rollout's parameters in place (a state dict's load, the colocated
    sink's ``_foreach_copy_``): the fused weight changes with them."""
    plain, fused = pair()
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in plain.state_dict().items()}
    plain.load_state_dict(new)
    fused.load_state_dict(new)
    assert torch.equal(greedy(fused), greedy(plain))
    params = dict(fused.named_parameters())
    with torch.no_grad():
        torch._foreach_copy_([params[n] for n in params], [dict(plain.named_parameters())[n] * 2 for n in params])
        for p in plain.parameters():
            p.mul_(2)
    assert refuse(fused) == 0  # nothing was cut off
    assert torch.equal(greedy(fused), greedy(plain))


def test_a_parameter_cut_off_from_the_fused_weight_is_fused_again():
    """A ``.to`` that copies the parameters (or a parameter replaced) leaves the fused weight
    behind; the next generation finds it by data pointer and fuses again, keeping the parameter
    objects, so that what holds them (a colocated sink) still writes into the fused weight."""
    plain, fused = pair()
    plain, fused = plain.to(torch.float64), fused.to(torch.float64)
    held = dict(fused.named_parameters())  # as the sink pairs them
    with torch.no_grad():
        fused.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(plain.model.layers[1].mlp.up_proj.weight.clone())
    assert torch.equal(greedy(fused), greedy(plain))  # generate_static fused again first
    assert refuse(fused) == 0 and all(m.rrl_fused_weight.dtype == torch.float64 for m in fused_modules(fused))
    replaced = "model.layers.1.mlp.up_proj.weight"
    assert all(p is held[n] for n, p in fused.named_parameters() if n != replaced)
    with torch.no_grad():  # a sync through the held objects reaches the fused weights
        for name, p in plain.named_parameters():
            p.mul_(1.5)
            (held[name] if name != replaced else dict(fused.named_parameters())[name]).copy_(p)
    assert refuse(fused) == 0 and torch.equal(greedy(fused), greedy(plain))
    # A projection that is no longer a plain linear map: that module goes back to the model's own forward.
    mlp = fused.model.layers[0].mlp
    mlp.gate_proj = torch.nn.Sequential(mlp.gate_proj)
    plain.model.layers[0].mlp.gate_proj = torch.nn.Sequential(plain.model.layers[0].mlp.gate_proj)
    assert refuse(fused) == 0 and type(mlp) is type(plain.model.layers[0].mlp) and not hasattr(mlp, "rrl_fused_weight")
    assert torch.equal(greedy(fused), greedy(plain))


def test_models_of_other_classes_are_left_as_they_are():
    from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig

    tiny = TinyCausalLM(TinyLMConfig(vocab_size=32, hidden_size=16, num_heads=2))
    assert fuse_projections(tiny) == 0 and not fused_modules(tiny)
    _, fused = pair()
    assert fuse_projections(fused) == 0  # already fused


def test_the_compiled_decode_step_makes_four_products_a_layer_not_seven():
    """The compiler's own graph of the decode step: per layer one product for query, key and
    value, one for gate and up, the output and down projections, and the head: ``4 * LAYERS + 1``
    linear maps against ``7 * LAYERS + 1`` for the model unfused; and no graph break."""
    def linear_maps(model) -> tuple[int, dict]:
        with recorded_decode_graphs() as graphs:
            ids, mask = prompts()
            stats = generate_static(model, ids, mask, max_new_tokens=6, temperature=1.0, compile=True,
                                    generator=torch.Generator().manual_seed(0)).engine_stats
        assert len(graphs) == 1, stats
        return sum(1 for n in graphs[0].graph.nodes if n.op == "call_function"
                   and n.target is torch._C._nn.linear), stats

    plain, fused = pair()
    unfused_count, _ = linear_maps(plain)
    fused_count, stats = linear_maps(fused)
    assert (unfused_count, fused_count) == (7 * LAYERS + 1, 4 * LAYERS + 1)
    assert stats["graph_breaks"] == 0 and stats["eager_fallback"] is None
