"""Models built empty (parameters on the meta device, allocated on the device without being
initialised) become, once a state is loaded, exactly the model that state came from."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from resilient_rl.config.schema import config_from_dict
from resilient_rl.errors import WorkerError
from resilient_rl.models.factory import build_causal_lm, build_value_model
from resilient_rl.models.hf import tiny_llama_config
from resilient_rl.protocol import DataProto
from resilient_rl.workers.fsdp import DevicePlan, has_meta_parameters, materialize, to_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.rollout import NO_WEIGHTS, RolloutEngine

CPU = torch.device("cpu")
VOCAB = 50
TINY = SimpleNamespace(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
TIED = SimpleNamespace(**vars(TINY), tie_embeddings=True)
HF = SimpleNamespace(kind="hf", hf_config=tiny_llama_config(VOCAB, hidden_size=32, intermediate_size=64))


def _ids():
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_cfg", [TINY, TIED, HF], ids=["tiny", "tied", "hf"])
def test_empty_causal_lm_loaded_equals_the_initialised_one(model_cfg):
    if model_cfg is HF:
        pytest.importorskip("transformers")
    initialised = build_causal_lm(model_cfg, VOCAB, seed=3)
    empty = build_causal_lm(model_cfg, VOCAB, seed=3, empty=True)
    assert has_meta_parameters(empty) and not any(b.is_meta for b in empty.buffers())
    rng = torch.get_rng_state()
    empty = to_device(empty, CPU)
    assert torch.equal(rng, torch.get_rng_state())  # building empty draws nothing
    assert not has_meta_parameters(empty)
    for (name, b), (_, ref) in zip(empty.named_buffers(), initialised.named_buffers()):
        assert torch.equal(b, ref), name  # values computed at construction (rotary frequencies) kept
    empty.load_state_dict(initialised.state_dict())
    assert torch.equal(empty(_ids()).logits, initialised(_ids()).logits)


def test_a_tied_head_stays_tied_and_trains_as_one_parameter():
    model = to_device(build_causal_lm(TIED, VOCAB, seed=3, empty=True), CPU)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(build_causal_lm(TIED, VOCAB, seed=3).parameters()))


def test_empty_value_model_keeps_its_head_shape_and_dtype():
    model = build_value_model(TINY, VOCAB, seed=4, empty=True)
    assert model.value_head.weight.is_meta and model.value_head.weight.shape == (1, TINY.hidden_size)
    model = to_device(model, CPU)
    ref = build_value_model(TINY, VOCAB, seed=4)
    model.load_state_dict(ref.state_dict())
    assert torch.equal(model(_ids()), ref(_ids()))


def test_fsdp2_sharded_empty_model_gets_its_shards_from_a_full_state(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    ref = build_causal_lm(TIED, VOCAB, seed=5)
    fully_shard(ref, mesh=mesh)
    model = build_causal_lm(TIED, VOCAB, seed=5, empty=True)
    fully_shard(model, mesh=mesh)
    materialize(model, CPU)
    assert type(model.lm_head.weight).__name__ == "DTensor" and model.lm_head.weight is model.embed_tokens.weight
    set_model_state_dict(model, get_model_state_dict(ref))
    assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


def test_empty_policy_engine_restored_from_a_state_dict_trains_identically():
    plan = DevicePlan(CPU, torch.float32, torch.float32)
    actor_cfg = config_from_dict({}).actor
    ref = PolicyEngine(TINY, VOCAB, 7, plan, actor_cfg=actor_cfg)
    engine = PolicyEngine(TINY, VOCAB, 7, plan, actor_cfg=actor_cfg, empty=True)
    engine.model.load_state_dict(ref.model.state_dict())
    for p, q in zip(engine.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
    assert engine.optimizer.param_groups[0]["params"][0] is next(engine.model.parameters())


def test_an_empty_rollout_refuses_to_generate_until_it_gets_weights():
    cfg = config_from_dict({})
    plan = DevicePlan(CPU, torch.float32, torch.float32)
    rollout = RolloutEngine(TINY, cfg.rollout, VOCAB, 1, plan, eos_token_id=1, pad_token_id=0, empty=True)
    assert rollout.version == NO_WEIGHTS
    prompts = DataProto.from_dict({"input_ids": _ids(), "attention_mask": torch.ones(2, 6, dtype=torch.long)},
                                  meta_info={"step": 1, "max_new_tokens": 2})
    with pytest.raises(WorkerError, match="no weights yet"):
        rollout.generate_sequences(prompts, rank=0)
    rollout.load_weights(build_causal_lm(TINY, VOCAB, 1).state_dict(), version=0)
    assert rollout.generate_sequences(prompts, rank=0).batch["responses"].shape == (2, 2)
