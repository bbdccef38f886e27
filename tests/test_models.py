"""Tests for resilient_rl.models: the tiny LM, Hugging Face loading, the value model and generation."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from resilient_rl.errors import ConfigError
from resilient_rl.models import (
    CausalLMWithValueHead,
    TinyLMConfig,
    build_causal_lm,
    build_value_model,
    compute_position_ids,
    generate,
    load_hf_causal_lm,
    sample_next_token,
    tiny_llama_config,
    transformer_blocks,
)

VOCAB = 32
NUM_LAYERS = 2


def tiny_cfg(**overrides):
    base = dict(kind="tiny", path=None, hf_config=None, hidden_size=32, num_layers=NUM_LAYERS, num_heads=4,
                intermediate_size=64, max_seq_len=32)
    base.update(overrides)
    return SimpleNamespace(**base)


def hf_cfg():
    return SimpleNamespace(kind="hf", path=None, hf_config=tiny_llama_config(
        VOCAB, hidden_size=32, num_layers=NUM_LAYERS, num_heads=4, intermediate_size=64,
        max_position_embeddings=64))


@pytest.fixture(scope="module")
def tiny_model():
    return build_causal_lm(tiny_cfg(), VOCAB, seed=1).eval()


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers")
    return build_causal_lm(hf_cfg(), VOCAB, seed=1).eval()


def model_of_kind(kind, request):
    """The module-scoped tiny or Hugging Face model (the latter skips without transformers)."""
    return request.getfixturevalue("tiny_model" if kind == "tiny" else "hf_model")


def left_padded_prompts():
    """Three prompts of lengths 5, 3 and 1, left-padded with token 0."""
    ids = torch.tensor([[3, 9, 4, 17, 8], [0, 0, 21, 5, 30], [0, 0, 0, 0, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    return ids, mask


# ---------------------------------------------------------------------------------------------- tiny


def test_tiny_forward_shapes_and_cache(tiny_model):
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    out = tiny_model(ids, use_cache=True)
    assert out.logits.shape == (2, 7, VOCAB)
    assert len(out.past_key_values) == NUM_LAYERS
    k, v = out.past_key_values[0]
    assert k.shape == v.shape == (2, 4, 7, 8)  # [B, heads, T, head_dim]
    assert tiny_model(ids).past_key_values is None
    assert isinstance(tiny_model.layers, torch.nn.ModuleList) and len(tiny_model.layers) == NUM_LAYERS
    assert tiny_model.get_input_embeddings().weight.shape == (VOCAB, 32)
    assert tiny_model.config.vocab_size == VOCAB


def test_tiny_cached_forward_matches_full_forward(tiny_model):
    ids, mask = left_padded_prompts()
    full = tiny_model(ids, attention_mask=mask).logits
    prefix = tiny_model(ids[:, :3], attention_mask=mask[:, :3], use_cache=True)
    rest = tiny_model(ids[:, 3:], attention_mask=mask, past_key_values=prefix.past_key_values)
    torch.testing.assert_close(rest.logits, full[:, 3:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["tiny", "hf"])
def test_left_padding_does_not_change_real_token_logits(kind, request):
    model = model_of_kind(kind, request)
    ids, mask = left_padded_prompts()
    padded = model(input_ids=ids, attention_mask=mask, position_ids=compute_position_ids(mask)).logits
    assert torch.isfinite(padded).all()
    for row in range(ids.shape[0]):
        real = ids[row][mask[row].bool()][None]
        alone = model(input_ids=real).logits[0]
        torch.testing.assert_close(padded[row][mask[row].bool()], alone, rtol=0, atol=1e-5)


def test_tiny_default_positions_skip_left_padding(tiny_model):
    ids, mask = left_padded_prompts()
    explicit = tiny_model(ids, attention_mask=mask, position_ids=compute_position_ids(mask)).logits
    default = tiny_model(ids, attention_mask=mask).logits
    assert torch.equal(explicit, default)
    assert compute_position_ids(mask).tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2], [0, 0, 0, 0, 0]]


def test_tiny_position_past_max_seq_len_is_a_config_error(tiny_model):
    with pytest.raises(ConfigError, match="max_seq_len"):
        tiny_model(torch.zeros((1, 33), dtype=torch.long))


def test_tiny_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="num_heads"):
        TinyLMConfig(vocab_size=8, hidden_size=30, num_heads=4)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        TinyLMConfig(vocab_size=0)


def test_tied_embeddings_share_the_weight():
    model = build_causal_lm(tiny_cfg(tie_embeddings=True), VOCAB, seed=0)
    assert model.lm_head.weight is model.embed_tokens.weight


# ------------------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
@pytest.mark.parametrize("kind", ["tiny", "hf"])
def test_kv_cache_generation_equals_no_cache(kind, temperature, top_p, request):
    model = model_of_kind(kind, request)
    ids, mask = left_padded_prompts()
    outs, step_logits = [], []
    for use_cache in (True, False):
        seen = []
        hook = model.register_forward_hook(lambda _m, _a, out, seen=seen: seen.append(out.logits[:, -1]))
        try:
            # The cache goes by the keyword the model's forward names (transformers 5 renamed
            # ``past_key_values`` to ``cache``; a name it no longer reads would lose the cache).
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
                outs.append(generate(model, ids, mask, max_new_tokens=8, temperature=temperature, top_p=top_p,
                                     generator=torch.Generator().manual_seed(7), use_cache=use_cache))
        finally:
            hook.remove()
        step_logits.append(torch.stack(seen))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    # Each cached step sees what a full forward sees (positions, mask and cache line up).
    torch.testing.assert_close(step_logits[0], step_logits[1], rtol=0, atol=1e-5)
    assert torch.equal(outs[0].response_mask, outs[1].response_mask)
    assert outs[0].responses.shape == (3, 8)
    if temperature > 0:
        # Sampling really samples: rows do not all collapse to one token.
        assert outs[0].responses.unique().numel() > 3


def test_seeded_generator_reproduces_samples(tiny_model):
    ids, mask = left_padded_prompts()

    def run(seed):
        return generate(tiny_model, ids, mask, max_new_tokens=10, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed)).responses

    assert torch.equal(run(123), run(123))
    assert not torch.equal(run(123), run(124))


def test_generation_positions_and_masks_without_eos(tiny_model):
    ids, mask = left_padded_prompts()
    out = generate(tiny_model, ids, mask, max_new_tokens=4, temperature=0.0)
    assert out.sequences.shape == (3, 9)
    assert torch.equal(out.sequences[:, :5], ids)
    assert torch.equal(out.sequences[:, 5:], out.responses)
    assert out.response_mask.tolist() == [[1] * 4] * 3
    assert torch.equal(out.attention_mask, torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], dim=1))
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8],
                                         [0, 0, 0, 1, 2, 3, 4, 5, 6],
                                         [0, 0, 0, 0, 0, 1, 2, 3, 4]]
    # The returned positions/mask reproduce generation's logits in one forward pass.
    logits = tiny_model(out.sequences, attention_mask=out.attention_mask, position_ids=out.position_ids).logits
    assert torch.equal(logits[:, 4:-1].argmax(-1), out.responses)


@pytest.mark.parametrize("kind", ["tiny", "hf"])
def test_eos_stops_a_row_and_masks_after_it(kind, request):
    model = model_of_kind(kind, request)
    ids, mask = left_padded_prompts()
    free = generate(model, ids, mask, max_new_tokens=8, temperature=0.0).responses
    eos = int(free[0, 2])
    pad = VOCAB + 5  # outside the vocabulary, so padding is unmistakable
    out = generate(model, ids, mask, max_new_tokens=8, temperature=0.0, eos_token_id=eos, pad_token_id=pad)
    assert out.responses.shape == (3, 8)
    for row in range(3):
        hits = (free[row] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 8
        assert out.responses[row, :stop].tolist() == free[row, :stop].tolist()
        assert out.responses[row, stop:].tolist() == [pad] * (8 - stop)
        assert out.response_mask[row].tolist() == [1] * stop + [0] * (8 - stop)
    assert int(out.response_mask[0].sum()) <= 3
    assert torch.equal(out.attention_mask[:, 5:], out.response_mask)


def test_all_rows_finished_stops_early_with_fixed_shape(tiny_model):
    ids, mask = left_padded_prompts()
    calls = []
    hook = tiny_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = generate(tiny_model, ids, mask, max_new_tokens=6, temperature=1.0, eos_token_id=list(range(VOCAB)),
                       pad_token_id=0, generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    assert len(calls) == 1  # every row ended at its first token: no second step was run
    assert out.responses.shape == (3, 6)
    assert out.response_mask.tolist() == [[1, 0, 0, 0, 0, 0]] * 3
    assert out.responses[:, 1:].tolist() == [[0] * 5] * 3


def test_tiny_top_p_keeps_only_the_argmax(tiny_model):
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(3))
    picked = sample_next_token(logits, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(picked, logits.argmax(-1))
    ids, mask = left_padded_prompts()
    greedy = generate(tiny_model, ids, mask, max_new_tokens=6, temperature=0.0)
    nucleus = generate(tiny_model, ids, mask, max_new_tokens=6, temperature=1.0, top_p=1e-6,
                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy.sequences, nucleus.sequences)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.tensor([0.1, 0.4, 0.3, 0.2]).log().expand(2000, 4)
    picked = sample_next_token(logits, temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert set(picked.tolist()) == {1, 2}  # 0.4 alone is short of 0.5; 0.4 + 0.3 reaches it
    everything = sample_next_token(logits, temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(0))
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_generation_argument_errors_name_the_argument(tiny_model):
    ids, mask = left_padded_prompts()
    with pytest.raises(ConfigError, match="top_p"):
        generate(tiny_model, ids, mask, max_new_tokens=2, top_p=0.0)
    with pytest.raises(ConfigError, match="temperature"):
        generate(tiny_model, ids, mask, max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(tiny_model, ids, mask, max_new_tokens=0)


# ----------------------------------------------------------------------------------------------- value


@pytest.mark.parametrize("kind", ["tiny", "hf"])
def test_value_model_shape_and_gradients(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    model = build_value_model(tiny_cfg() if kind == "tiny" else hf_cfg(), VOCAB, seed=2)
    assert isinstance(model, CausalLMWithValueHead)
    ids, mask = left_padded_prompts()
    values = model(ids, attention_mask=mask, position_ids=compute_position_ids(mask))
    assert values.shape == (3, 5) and values.dtype == torch.float32
    assert torch.isfinite(values).all()
    values[mask.bool()].sum().backward()
    assert model.value_head.weight.grad is not None and model.value_head.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.layers.parameters())
    # The LM head is dropped: no [hidden, vocab] output matrix remains besides the input embedding.
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names)
    assert model.get_input_embeddings().weight.shape == (VOCAB, 32)


def test_value_model_left_padding_invariance():
    model = build_value_model(tiny_cfg(), VOCAB, seed=2)
    ids, mask = left_padded_prompts()
    padded = model(ids, attention_mask=mask)
    alone = model(ids[1:2, 2:])
    torch.testing.assert_close(padded[1, 2:], alone[0], rtol=0, atol=1e-5)


def test_hf_value_model_asks_only_for_the_last_hidden_state():
    """Every layer's hidden state (output_hidden_states) would stay alive until the values are
    computed; the base model's own output is the final one, and the values are the same."""
    pytest.importorskip("transformers")
    model = build_value_model(hf_cfg(), VOCAB, seed=2).eval()
    ids, mask = left_padded_prompts()
    position_ids = compute_position_ids(mask)
    asked: list[dict] = []
    handle = model.backbone.register_forward_pre_hook(lambda m, a, kw: asked.append(dict(kw)), with_kwargs=True)
    try:
        with torch.no_grad():
            values = model(ids, attention_mask=mask, position_ids=position_ids)
    finally:
        handle.remove()
    assert len(asked) == 1 and not asked[0].get("output_hidden_states")
    with torch.no_grad():
        every = model.backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                               output_hidden_states=True).hidden_states
        expected = torch.nn.functional.linear(every[-1], model.value_head.weight[0], model.value_head.bias[0])
    assert torch.equal(values, expected.float())


# --------------------------------------------------------------------------------------------- factory


def test_transformer_blocks_finds_the_layers(tiny_model, hf_model):
    assert transformer_blocks(tiny_model) is tiny_model.layers
    assert transformer_blocks(hf_model) is hf_model.model.layers
    assert len(transformer_blocks(hf_model)) == NUM_LAYERS
    tiny_value = build_value_model(tiny_cfg(), VOCAB, seed=0)
    assert transformer_blocks(tiny_value) is tiny_value.backbone.layers
    hf_value = build_value_model(hf_cfg(), VOCAB, seed=0)
    assert transformer_blocks(hf_value) is hf_value.backbone.layers
    assert len(transformer_blocks(hf_value)) == NUM_LAYERS
    with pytest.raises(ConfigError, match="Linear"):
        transformer_blocks(torch.nn.Linear(2, 2))


def test_missing_hf_path_is_a_config_error_naming_the_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match="no-such-model"):
        load_hf_causal_lm(path=missing)
    with pytest.raises(ConfigError, match="no-such-model"):
        build_causal_lm(SimpleNamespace(kind="hf", path=missing, hf_config=None), VOCAB, seed=0)
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(ConfigError, match="empty-dir"):
        load_hf_causal_lm(path=str(empty))


def test_hf_model_round_trips_through_a_local_directory(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "m")
    loaded = build_causal_lm(SimpleNamespace(kind="hf", path=str(tmp_path / "m"), hf_config=None), VOCAB, seed=9)
    ids, mask = left_padded_prompts()
    torch.testing.assert_close(loaded.eval()(input_ids=ids, attention_mask=mask).logits,
                               hf_model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_factory_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.kind"):
        build_causal_lm(tiny_cfg(kind="gpt"), VOCAB, seed=0)
    with pytest.raises(ConfigError, match="model_type"):
        load_hf_causal_lm(hf_config={"hidden_size": 8})
    with pytest.raises(ConfigError, match="exactly one"):
        load_hf_causal_lm()
    cfg = hf_cfg()
    cfg.hf_config = {**cfg.hf_config, "vocab_size": VOCAB - 1}
    with pytest.raises(ConfigError, match="vocab_size"):
        build_causal_lm(cfg, VOCAB, seed=0)


@pytest.mark.parametrize("make_cfg", [tiny_cfg, hf_cfg], ids=["tiny", "hf"])
@pytest.mark.parametrize("build", [build_causal_lm, build_value_model], ids=["lm", "value"])
def test_same_seed_same_parameters_and_global_rng_untouched(make_cfg, build):
    if make_cfg is hf_cfg:
        pytest.importorskip("transformers")
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    a = build(make_cfg(), VOCAB, seed=5).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)
    b = build(make_cfg(), VOCAB, seed=5).state_dict()
    c = build(make_cfg(), VOCAB, seed=6).state_dict()
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


# ------------------------------------------------------------------------------------------------ FSDP2


def test_fsdp2_shards_blocks_then_root_and_matches_unsharded(single_rank_group):
    from torch.distributed.fsdp import fully_shard

    ids, mask = left_padded_prompts()
    pos = compute_position_ids(mask)
    for build in (build_causal_lm, build_value_model):
        reference = build(tiny_cfg(), VOCAB, seed=4)
        sharded = build(tiny_cfg(), VOCAB, seed=4)
        for block in transformer_blocks(sharded):
            fully_shard(block)
        fully_shard(sharded)
        if build is build_causal_lm:
            expected = generate(reference, ids, mask, max_new_tokens=5, temperature=1.0,
                                generator=torch.Generator().manual_seed(1))
            got = generate(sharded, ids, mask, max_new_tokens=5, temperature=1.0,
                           generator=torch.Generator().manual_seed(1))
            assert torch.equal(expected.sequences, got.sequences)
        else:
            expected = reference(ids, attention_mask=mask, position_ids=pos)
            got = sharded(ids, attention_mask=mask, position_ids=pos)
            assert torch.equal(expected, got)
            got.sum().backward()
            assert sharded.value_head.weight.grad is not None
