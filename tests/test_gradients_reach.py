"""An update's gradients reach the parameters its optimizer steps.

FSDP2 of torch 2.11 found a sharded root's output tensors with pytree; the tiny model's output,
a plain dataclass, was a leaf to it, so the root's backward hooks never ran and a sharded CPU run
trained nothing, silently. The output is now a pytree node, and an update whose gradients miss
the optimizer's parameters stops with an error that says so."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

from resilient_rl.errors import GradientError
from resilient_rl.models import CausalLMOutput, TinyCausalLM, TinyLMConfig
from resilient_rl.workers.fsdp import check_gradients_reach


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(TinyLMConfig(vocab_size=11, hidden_size=16, num_layers=2, num_heads=2,
                                     intermediate_size=32, max_seq_len=8))


def test_the_models_output_flattens_to_its_tensors():
    out = _model()(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, output_hidden_states=True)
    assert isinstance(out, CausalLMOutput)
    leaves, spec = tree_flatten(out)
    assert any(leaf is out.logits for leaf in leaves), "the logits are a leaf of the output, not the output itself"
    assert any(leaf is out.hidden_states[0] for leaf in leaves)
    assert spec.unflatten(leaves).logits is out.logits


def test_a_sharded_root_gives_its_shards_the_gradients(single_rank_group):
    """The run's case: FSDP2 over the whole model (the root alone, as on CPU), a no-grad forward
    (the log-probs) and then an update: every parameter the optimizer holds changes."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().full_tensor().clone() for p in optimizer.param_groups[0]["params"]]
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    check_gradients_reach(model, optimizer, "actor")
    optimizer.step()
    after = [p.detach().full_tensor() for p in optimizer.param_groups[0]["params"]]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


def test_gradients_that_miss_the_optimizers_parameters_stop_the_update():
    model = _model()
    # The optimizer steps other tensors than the ones the forward used: what a wrapper whose
    # backward hooks did not run leaves behind.
    elsewhere = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    optimizer = torch.optim.AdamW(elsewhere, lr=1e-2)
    check_gradients_reach(model, optimizer, "actor")  # no backward yet: nothing to say
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    with pytest.raises(GradientError, match=r"actor update: the backward gave \d+ parameters of TinyCausalLM"):
        check_gradients_reach(model, optimizer, "actor")
    check_gradients_reach(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "actor")
