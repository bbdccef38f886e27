"""The static rollout engine (models/engine.py) against the plain generation loop: greedy tokens,
shared prefill, several eos ids, compaction of finished rows, seeded determinism, on-device sampling
and the choice made by ``rollout.engine``. Tiny and Hugging Face (tiny Llama, random weights) models."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.config.sections import ConfigFieldError, RolloutConfig
from resilient_rl.errors import ConfigError
from resilient_rl.models.engine import (
    _TinyBackend,
    compaction_rows,
    generate_static,
    resolve_engine,
    shared_prompt_groups,
)
from resilient_rl.models.generation import generate
from resilient_rl.models.hf import load_hf_causal_lm, tiny_llama_config
from resilient_rl.models.sampling import sample_tokens
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.models.value import CausalLMWithValueHead

VOCAB = 32


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(1)
    return TinyCausalLM(TinyLMConfig(vocab_size=VOCAB, hidden_size=32, max_seq_len=64)).eval()


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(1)
    return load_hf_causal_lm(hf_config=tiny_llama_config(VOCAB, hidden_size=32, intermediate_size=64)).eval()


@pytest.fixture(params=["tiny", "hf"])
def model(request):
    return request.getfixturevalue("tiny" if request.param == "tiny" else "llama")


def prompts(n: int = 1):
    """Three left-padded prompts of lengths 6, 4, 2, each repeated ``n`` times (adjacent)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 2), (2, 4)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)


def assert_same_output(a, b):
    for name in ("sequences", "responses", "response_mask", "attention_mask", "position_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def frequent_tokens(model, ids, mask, k=2):
    """Tokens the greedy plain path produces most often: eos ids that really end rows."""
    free = generate(model, ids, mask, max_new_tokens=12, temperature=0.0).responses
    return free.flatten().bincount(minlength=VOCAB).argsort(descending=True)[:k].tolist()


def test_greedy_equals_plain_path_without_eos(model):
    ids, mask = prompts(n=2)
    plain = generate(model, ids, mask, max_new_tokens=10, temperature=0.0)
    static = generate_static(model, ids, mask, max_new_tokens=10, temperature=0.0)
    assert_same_output(plain, static)


@pytest.mark.parametrize("check_every,min_fraction", [(1, 0.0), (3, 0.25), (2, 1.0)])
def test_greedy_with_several_eos_ids_equals_plain_path(model, check_every, min_fraction):
    ids, mask = prompts(n=2)
    eos = frequent_tokens(model, ids, mask)
    plain = generate(model, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos, pad_token_id=VOCAB + 3)
    static = generate_static(model, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=torch.tensor(eos),
                             pad_token_id=VOCAB + 3, check_every=check_every, compact_min_fraction=min_fraction)
    assert_same_output(plain, static)
    lengths = plain.response_mask.sum(1)
    assert (lengths < 12).any(), "the eos ids must end some rows for this test to mean anything"
    for row, length in enumerate(lengths.tolist()):
        assert static.responses[row, length - 1].item() in eos or length == 12
        assert static.responses[row, length:].tolist() == [VOCAB + 3] * (12 - length)


def test_single_eos_id_still_works(tiny):
    ids, mask = prompts()
    eos = frequent_tokens(tiny, ids, mask, k=1)[0]
    plain = generate(tiny, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos)
    assert_same_output(plain, generate_static(tiny, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos))


def test_shared_prefill_groups_adjacent_identical_prompts():
    ids, mask = prompts(n=3)
    group, first = shared_prompt_groups(ids, mask)
    assert group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and first.tolist() == [0, 3, 6]
    # Same tokens under a different mask are different prompts; non-adjacent repeats are not merged.
    mask2 = mask.clone()
    mask2[1, -1] = 0
    assert shared_prompt_groups(ids, mask2)[1].tolist() == [0, 1, 2, 3, 6]
    order = [0, 3, 1, 2, 4, 5, 6, 7, 8]
    assert shared_prompt_groups(ids[order], mask[order])[1].tolist() == [0, 1, 2, 4, 6]


def test_shared_prefill_cache_equals_repeated_prefill(tiny):
    ids, mask = prompts(n=4)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    shared, repeated = _TinyBackend(tiny), _TinyBackend(tiny)
    group, first = shared_prompt_groups(ids, mask)
    logits_shared = shared.prefill(ids[first], pos[first], mask[first], total_len=16)
    shared.select(group)
    logits_repeated = repeated.prefill(ids, pos, mask, total_len=16)
    torch.testing.assert_close(logits_shared[group], logits_repeated, rtol=0, atol=1e-6)
    for a, b in zip(shared.cache.keys + shared.cache.values, repeated.cache.keys + repeated.cache.values):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class BatchSpy:
    """Records the ``input_ids`` shape of every forward the engine runs (the tiny model's static
    path is ``forward_static``, a Hugging Face model's is ``forward``)."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __enter__(self):
        if isinstance(self.model, TinyCausalLM):
            original = self.model.forward_static

            def spy(input_ids, *args, **kwargs):
                self.shapes.append(tuple(input_ids.shape))
                return original(input_ids, *args, **kwargs)

            self.model.forward_static = spy
        else:
            self.hook = self.model.register_forward_pre_hook(
                lambda _m, _a, kwargs: self.shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        return self

    def __exit__(self, *exc):
        if isinstance(self.model, TinyCausalLM):
            del self.model.forward_static
        else:
            self.hook.remove()


def test_shared_prefill_runs_one_prefill_row_per_prompt(model):
    ids, mask = prompts(n=4)
    with BatchSpy(model) as spy:
        generate_static(model, ids, mask, max_new_tokens=3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert spy.shapes == [(3, 6), (12, 1), (12, 1)]


def test_greedy_samples_of_a_shared_prompt_agree(model):
    ids, mask = prompts(n=3)
    out = generate_static(model, ids, mask, max_new_tokens=8, temperature=0.0)
    alone = generate_static(model, ids[::3], mask[::3], max_new_tokens=8, temperature=0.0)
    assert torch.equal(out.responses, alone.responses.repeat_interleave(3, 0))


def test_seeded_generation_is_reproducible(model):
    ids, mask = prompts(n=2)
    eos = frequent_tokens(model, ids, mask)

    def run(seed):
        return generate_static(model, ids, mask, max_new_tokens=10, temperature=1.0, eos_token_id=eos,
                               generator=torch.Generator().manual_seed(seed), check_every=2,
                               compact_min_fraction=0.0)

    a, b, c = run(11), run(11), run(12)
    assert_same_output(a, b)
    assert not torch.equal(a.responses, c.responses)
    # The n samples of one prompt are different draws, not copies of one.
    assert not torch.equal(a.responses[0], a.responses[1]) or not torch.equal(a.responses[2], a.responses[3])


def test_compaction_rows_keeps_unfinished_rows_in_order():
    finished = torch.tensor([True, False, True, True, False, True, True, True])
    assert compaction_rows(finished, 2, min_fraction=0.25).tolist() == [1, 4]
    # Bucketed: the batch shrinks to a multiple, padded with (the first) finished rows.
    assert compaction_rows(finished, 2, min_fraction=0.25, multiple=4).tolist() == [0, 1, 2, 4]
    # Not worth it: fewer than min_fraction of the rows would leave.
    assert compaction_rows(finished, 7, min_fraction=0.25) is None
    assert compaction_rows(finished, 2, min_fraction=0.9) is None
    assert compaction_rows(finished, 6, min_fraction=0.0, multiple=8) is None


def test_compaction_drops_finished_rows_from_the_decode_batch(model):
    ids, mask = prompts(n=4)
    eos = frequent_tokens(model, ids, mask)
    with BatchSpy(model) as spy:
        compacted = generate_static(model, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos,
                                    check_every=1, compact_min_fraction=0.0)
    batches = [shape[0] for shape in spy.shapes]
    assert batches[0] == 3 and min(batches[1:]) < 12
    assert batches[1:] == sorted(batches[1:], reverse=True)
    assert_same_output(compacted, generate(model, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos))


def test_device_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.4, 0.3, 0.2])
    logits = probs.log().expand(20000, 4)
    picked = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    freq = picked.bincount(minlength=4).float() / picked.numel()
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.015)
    nucleus = sample_tokens(logits, 1.0, 0.5, torch.Generator().manual_seed(0))
    assert set(nucleus.tolist()) == {1, 2}
    assert torch.equal(sample_tokens(logits[:5], 0.0, 1.0, None), torch.ones(5, dtype=torch.long))


def test_position_past_the_model_limit_is_a_config_error(tiny):
    ids, mask = prompts()
    with pytest.raises(ConfigError, match="model.max_seq_len=64"):
        generate_static(tiny, ids, mask, max_new_tokens=59, temperature=0.0)


def test_engine_choice(tiny, llama):
    value_model = CausalLMWithValueHead(TinyCausalLM(TinyLMConfig(vocab_size=VOCAB)))
    assert resolve_engine("auto", tiny) == "static" and resolve_engine("auto", llama) == "static"
    assert resolve_engine("plain", tiny) == "plain"
    assert resolve_engine("auto", value_model) == "plain"
    with pytest.raises(ConfigError, match="rollout.engine='static' cannot run"):
        resolve_engine("static", value_model)
    with pytest.raises(ConfigError, match="rollout.engine"):
        resolve_engine("fast", tiny)
    with pytest.raises(ConfigFieldError, match="engine"):
        RolloutConfig(engine="vllm")
    with pytest.raises(ConfigFieldError, match="finish_check_every"):
        RolloutConfig(finish_check_every=0)


def test_graphed_falls_back_to_the_eager_step_when_compiling_fails(monkeypatch, caplog):
    """The CUDA-graph wrapper's logic, on CPU: a compiler failure leaves a working eager step."""
    import resilient_rl.models.engine as engine

    def broken_compile(fn, **kwargs):
        assert kwargs == {"mode": "reduce-overhead", "dynamic": False}

        def fail(*args):
            raise RuntimeError("cannot capture")
        return fail

    monkeypatch.setattr(engine.torch, "compile", broken_compile)
    calls = []
    step = engine.graphed(lambda x: calls.append(x) or x + 1)
    assert step(1) == 2 and step(2) == 3 and calls == [1, 2]
    assert "decoding eagerly" in caplog.text


def test_decode_step_is_compiled_once_per_process(monkeypatch):
    import resilient_rl.models.engine as engine

    compiled = []
    monkeypatch.setattr(engine.torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    monkeypatch.setattr(engine, "_GRAPHED", {})
    first = engine.graphed_once(engine._TinyBackend.decode)
    assert engine.graphed_once(engine._TinyBackend.decode) is first
    engine.graphed_once(engine._HFBackend.decode)
    assert compiled == [engine._TinyBackend.decode, engine._HFBackend.decode]
