"""The static rollout engine (models/engine.py) against the plain generation loop: greedy tokens,
shared prefill, several eos ids, compaction of finished rows, seeded determinism, on-device sampling
and the choice made by ``rollout.engine``. Tiny and Hugging Face (tiny Llama, random weights) models."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.config.section import ConfigFieldError
from resilient_rl.config.sections import RolloutConfig
from resilient_rl.errors import ConfigError
from resilient_rl.models.decode_step import DecodeStep, row_buckets
from resilient_rl.models.engine import (
    compaction_rows,
    compiles_decode,
    engine_cache,
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


def test_decode_step_compiles_when_asked_or_on_cuda_by_default():
    assert compiles_decode(None, "cuda:0") and not compiles_decode(None, "cpu")
    assert compiles_decode(True, "cpu") and not compiles_decode(False, torch.device("cuda"))


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


def test_cache_is_kept_across_generations(tiny):
    """The buffers a rollout decodes into are the next rollout's too (a CUDA graph captured on them
    stays valid); a larger batch grows them once."""
    ids, mask = prompts(n=2)
    generate_static(tiny, ids, mask, max_new_tokens=4, temperature=0.0)
    first = engine_cache(tiny, engine_cache.__globals__["_tiny_shape"](tiny), 6, 128)
    addresses = [k.data_ptr() for k in first.keys]
    generate_static(tiny, ids[:4], mask[:4], max_new_tokens=4, temperature=0.0)
    again = engine_cache(tiny, first.shape, 4, 128)
    assert again is first and [k.data_ptr() for k in again.keys] == addresses
    ids8, mask8 = prompts(n=4)
    out = generate_static(tiny, ids8, mask8, max_new_tokens=4, temperature=0.0)
    assert engine_cache(tiny, first.shape, 12, 128).capacity == (12, 128)
    assert_same_output(out, generate(tiny, ids8, mask8, max_new_tokens=4, temperature=0.0))


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
    # Bucketed: the batch shrinks to the smallest bucket that holds the unfinished rows, padded
    # with (the first) finished rows.
    assert compaction_rows(finished, 2, min_fraction=0.25, buckets=[8, 4]).tolist() == [0, 1, 2, 4]
    # Not worth it: fewer than min_fraction of the rows would leave.
    assert compaction_rows(finished, 7, min_fraction=0.25) is None
    assert compaction_rows(finished, 2, min_fraction=0.9) is None
    assert compaction_rows(finished, 6, min_fraction=0.0, buckets=[8]) is None


def test_row_buckets_are_few_and_fixed():
    assert row_buckets(512, 8) == [512, 256, 128, 64]
    assert row_buckets(48, 8) == [48, 24, 16, 8]
    assert row_buckets(12, 8) == [12, 8]
    assert row_buckets(6, 1) == [6, 3, 2, 1]
    assert row_buckets(1, 1) == [1]


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


def test_a_failing_compiled_step_falls_back_to_eager_and_says_so(monkeypatch, caplog, tiny):
    """A compiler failure leaves a working eager step, reported in the generation's stats (the
    trainer turns it into a decode_eager event and the perf/decode_eager metric)."""
    import resilient_rl.models.decode_step as decode_step

    def broken_compile(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("cannot capture")
        return fail

    monkeypatch.setattr(decode_step.torch, "compile", broken_compile)
    monkeypatch.setattr(DecodeStep, "_compiled", {})
    monkeypatch.setattr(DecodeStep, "failure", None)
    ids, mask = prompts()
    out = generate_static(tiny, ids, mask, max_new_tokens=5, temperature=0.0, compile=True)
    assert out.engine_stats["eager_fallback"] == "RuntimeError: cannot capture"
    assert "decodes eagerly" in caplog.text
    assert_same_output(out, generate(tiny, ids, mask, max_new_tokens=5, temperature=0.0))
    # Later generations of the process stay eager and keep reporting why.
    again = generate_static(tiny, ids, mask, max_new_tokens=5, temperature=0.0, compile=True)
    assert not again.engine_stats["compiled"] and again.engine_stats["eager_fallback"]


def test_a_compiled_step_out_of_device_memory_raises_and_stays_compiled(monkeypatch, tiny):
    """Running out of memory is not a compiler failure: neither the kept nor the compiled step is
    dropped for it, and the error reaches the rollout's pass (which names the keys to change)."""
    import resilient_rl.models.decode_step as decode_step

    def out_of_memory(fn, **kwargs):
        def step(*args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return step

    monkeypatch.setattr(decode_step.torch, "compile", out_of_memory)
    monkeypatch.setattr(DecodeStep, "_compiled", {})
    monkeypatch.setattr(DecodeStep, "failure", None)
    monkeypatch.setattr(DecodeStep, "kept_failure", "not kept in this test")
    ids, mask = prompts()
    with pytest.raises(torch.OutOfMemoryError):
        generate_static(tiny, ids, mask, max_new_tokens=5, temperature=0.0, compile=True)
    assert DecodeStep.failure is None and DecodeStep.kept_failure == "not kept in this test"


def test_decode_step_is_compiled_once_per_process(monkeypatch):
    import resilient_rl.models.decode_step as decode_step

    compiled = []
    monkeypatch.setattr(decode_step.torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    monkeypatch.setattr(DecodeStep, "_compiled", {})
    monkeypatch.setattr(DecodeStep, "failure", None)
    first = DecodeStep(compile=True, cuda_graphs=True)._function()
    assert DecodeStep(compile=True, cuda_graphs=True)._function() is first
    DecodeStep(compile=True, cuda_graphs=False)._function()
    assert [kw["mode"] for kw in compiled] == ["reduce-overhead", None]
    assert all(kw["dynamic"] is None for kw in compiled)  # only the batch, marked at each call, is a symbol
