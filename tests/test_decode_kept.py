"""The decode step traced once and kept (models/decode_kept.py): its versions run whatever weights
the model holds, load back from bytes without tracing, refuse another model's file, and a step
that cannot be kept compiles as before. A fresh process on another node loading the run's kept
step is tested in test_compile_cache.py."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

import pytest
import torch

from resilient_rl.models import decode_kept
from resilient_rl.models.decode_kept import KeptSteps, load_kept, portable_guards, save_kept, step_key
from resilient_rl.models.decode_step import DecodeStep, decode
from resilient_rl.models.engine import generate_static
from resilient_rl.models.hf import load_hf_causal_lm, tiny_llama_config
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig

VOCAB = 40


def llama(seed: int, hidden: int = 32):
    torch.manual_seed(seed)
    return load_hf_causal_lm(hf_config=tiny_llama_config(VOCAB, hidden_size=hidden, intermediate_size=64)).eval()


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """No kept versions held yet, no failure seen and nothing compiled, as in a new process (a
    decode step another test compiled would be one more version to the compiler's cache)."""
    torch._dynamo.reset()
    monkeypatch.setattr(decode_kept, "_KEPT", {})
    monkeypatch.setattr(DecodeStep, "kept_failure", None)
    monkeypatch.setattr(DecodeStep, "failure", None)
    monkeypatch.setattr(DecodeStep, "_compiled", {})


def run(model, compile: bool, greedy: bool = False):
    ids = torch.randint(1, VOCAB, (6, 5), generator=torch.Generator().manual_seed(3))
    return generate_static(model, ids, torch.ones_like(ids), max_new_tokens=8, eos_token_id=[1, 2], compile=compile,
                           temperature=0.0 if greedy else 1.0, check_every=2,
                           generator=torch.Generator().manual_seed(7))


def test_a_kept_step_runs_the_weights_the_model_holds_now():
    first = llama(1)
    assert step_key(first) == step_key(llama(2))  # one configuration, another set of weights
    out = run(first, compile=True)
    assert out.engine_stats["kept"] and out.engine_stats["compiles"] == 1
    assert torch.equal(out.sequences, run(first, compile=False).sequences)
    first.load_state_dict(llama(2).state_dict())  # as a weight sync does
    again = run(first, compile=True)  # the same kept version: the weights are its inputs, not constants
    assert again.engine_stats["compiles"] == 0 and not torch.equal(again.sequences, out.sequences)
    assert torch.equal(again.sequences, run(first, compile=False).sequences)
    greedy = run(first, compile=True, greedy=True)  # no draw: one more version
    assert greedy.engine_stats["compiles"] == 1 and len(decode_kept.kept_steps(step_key(first), None).steps) == 2
    assert torch.equal(greedy.sequences, run(first, compile=False, greedy=True).sequences)


def test_kept_versions_load_from_bytes_and_run_without_tracing(monkeypatch):
    model = llama(1)
    compiled = run(model, compile=True)
    data, count = save_kept(step_key(model))
    assert count == 1 and len(data) > 10_000
    monkeypatch.setattr(decode_kept, "_KEPT", {})  # as a new process
    assert load_kept(data, step_key(model), decode) == 1
    loaded = run(model, compile=True)
    assert loaded.engine_stats["compiles"] == 0 and loaded.engine_stats["kept"]
    assert torch.equal(loaded.sequences, compiled.sequences)
    with pytest.raises(ValueError, match="kept for model key"):
        load_kept(data, step_key(llama(1, hidden=48)), decode)


def test_a_process_that_numbered_its_hooks_otherwise_runs_the_kept_step(monkeypatch):
    """Module hooks are numbered by a counter of the process: one that registered other hooks
    before it built the rollout model (an actor's FSDP2 hooks, say) gives the model's own hooks
    other numbers, and that must not cost a compile."""
    model = llama(1)
    compiled = run(model, compile=True)
    data, _ = save_kept(step_key(model))
    monkeypatch.setattr(decode_kept, "_KEPT", {})  # as a new process ...
    monkeypatch.setattr(torch.utils.hooks.RemovableHandle, "next_id", torch.utils.hooks.RemovableHandle.next_id + 7)
    again = llama(1)  # ... whose earlier hooks moved the numbers on
    assert load_kept(data, step_key(again), decode) == 1
    loaded = run(again, compile=True)
    assert loaded.engine_stats["compiles"] == 0 and loaded.engine_stats["kept"]
    assert torch.equal(loaded.sequences, compiled.sequences)


def test_step_key_names_the_model_class_and_configuration():
    assert step_key(llama(1)) != step_key(llama(1, hidden=48))
    torch.manual_seed(0)
    tiny = TinyCausalLM(TinyLMConfig(vocab_size=VOCAB, hidden_size=32, max_seq_len=64))
    assert step_key(tiny) != step_key(llama(1)) and len(step_key(tiny)) == 64


def test_portable_guards_keep_tensors_and_values_and_drop_identity_globals_and_hook_numbers():
    def entry(guard_type, is_global=False, derived=(), name="L['model']", value=None):
        return SimpleNamespace(guard_type=guard_type, is_global=is_global, derived_guard_types=derived, name=name,
                               value=value)

    class Local:  # as transformers' kernels wrapper: a class defined inside a function
        pass

    hooks = "model._modules['model']._forward_hooks"
    funcs = "L['model']._modules['model']._modules['layers']._modules['0']._modules['self_attn']._kernel_funcs"
    closure = f"dict(type({funcs}['rotary_pos_emb']).__dict__)['forward'].__closure__[0].cell_contents.__defaults__"
    entries = [entry("TENSOR_MATCH"), entry("EQUALS_MATCH"), entry("CONSTANT_MATCH", derived=("NONE_MATCH",)),
               entry("SHAPE_ENV"), entry("SEQUENCE_LENGTH", name=hooks),
               entry("TYPE_MATCH", value=torch.nn.Linear(1, 1)),
               entry("NOT_PRESENT_IN_GENERIC_DICT", name=funcs + "['rotary_pos_emb']", value=Local()),
               entry("ID_MATCH"), entry("CLOSURE_MATCH"),
               entry("TYPE_MATCH", is_global=True), entry("BUILTIN_MATCH", derived=("ID_MATCH",)),
               entry("DICT_CONTAINS", name=hooks + "_always_called"),
               entry("TYPE_MATCH", name=hooks + "_always_called[3]"),
               entry("TYPE_MATCH", name=funcs + "['rotary_pos_emb']", value=Local()),
               entry("HASATTR", derived=("TYPE_MATCH",), value=Local()),
               entry("SEQUENCE_LENGTH", name=closure, value=(1,))]
    assert portable_guards(entries) == [True] * 7 + [False] * 9


def _refuse_to_compile(self, step, args, mark):
    raise RuntimeError("this guard cannot be written down")


def _find_a_failing_version(self, args):
    def failing(*_):
        raise RuntimeError("this kept version cannot run here")
    return failing


@pytest.mark.parametrize("method, broken, logged", [
    ("compile", _refuse_to_compile, "kept decode step could not be compiled"),  # cannot be kept
    ("find", _find_a_failing_version, "kept decode step failed"),  # kept, but fails when called
])
def test_a_step_that_cannot_be_kept_or_fails_kept_compiles_as_before(monkeypatch, caplog, method, broken, logged):
    monkeypatch.setattr(KeptSteps, method, broken)
    model = llama(1)
    out = run(model, compile=True)
    stats = out.engine_stats
    assert stats["compiled"] and not stats["kept"] and stats["eager_fallback"] is None and stats["compiles"] >= 1
    assert "cannot" in DecodeStep.kept_failure and logged in caplog.text
    assert torch.equal(out.sequences, run(model, compile=False).sequences)


def test_loading_rebuilds_each_mode_under_its_settings_and_adds_nothing_from_a_file_that_fails(monkeypatch):
    """Inductor reads its CUDA-graph setting when it rebuilds a loaded version: a
    ``reduce-overhead`` version must be rebuilt with that setting on (CUDA graphs cannot run on a
    CPU; the loader is a fake that records the setting). A file that fails part way adds no
    version, so the next copy tried does not add ones held already."""
    seen = []

    def load(blob, f_globals):
        data = blob.read()
        if data == b"torn":
            raise EOFError("torn version")
        seen.append((data, torch._inductor.config.triton.cudagraphs))
        return SimpleNamespace(disable_guard_check=lambda: None)

    def file(*modes) -> bytes:
        return pickle.dumps({"key": "k", "modes": [{"mode": mode, "steps": steps} for mode, steps in modes]})

    monkeypatch.setattr(torch.compiler, "load_compiled_function", load)
    with pytest.raises(EOFError):
        load_kept(file(("reduce-overhead", [b"graphs"]), (None, [b"plain", b"torn"])), "k", decode)
    assert [len(decode_kept.kept_steps("k", mode).steps) for mode in ("reduce-overhead", None)] == [0, 0]
    seen.clear()
    assert load_kept(file(("reduce-overhead", [b"graphs"]), (None, [b"plain", b"plain 2"])), "k", decode) == 3
    assert seen == [(b"graphs", True), (b"plain", False), (b"plain 2", False)]
    assert not torch._inductor.config.triton.cudagraphs  # only while loading
    assert [len(decode_kept.kept_steps("k", mode).steps) for mode in ("reduce-overhead", None)] == [1, 2]


def test_a_torch_without_the_ahead_of_time_compile_compiles_the_step_as_before(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="resilient_rl.models.decode_step")
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    decode_kept.unkeepable.cache_clear()
    try:
        model = llama(1)
        out = run(model, compile=True)
    finally:
        decode_kept.unkeepable.cache_clear()
    stats = out.engine_stats
    assert stats["compiled"] and not stats["kept"] and stats["compiles"] >= 1 and stats["eager_fallback"] is None
    assert "has no ahead-of-time compile" in DecodeStep.kept_failure and "traced in every new process" in caplog.text
    assert not decode_kept.kept_steps(step_key(model), None).steps
    assert torch.equal(out.sequences, run(model, compile=False).sequences)


def test_a_torch_that_leaves_the_ahead_of_time_compile_off_still_keeps_the_step(monkeypatch):
    """torch 2.11: ``torch.compile`` returned a function without ``aot_compile``, its switch off by
    default. The step switches it on while it compiles and rebuilds kept versions. (The switch is
    set through the config's own patch: pytest's monkeypatch would delete the key on undo.)"""
    model = llama(1)
    default = torch._dynamo.config.enable_aot_compile  # True from torch 2.13, False in 2.11
    with torch._dynamo.config.patch(enable_aot_compile=False):
        out = run(model, compile=True)
        assert out.engine_stats["kept"] and out.engine_stats["compiles"] == 1, out.engine_stats
        assert torch.equal(out.sequences, run(model, compile=False).sequences)
        data, _ = save_kept(step_key(model))
        monkeypatch.setattr(decode_kept, "_KEPT", {})  # as a new process
        assert load_kept(data, step_key(model), decode) == 1
        loaded = run(model, compile=True)
        assert loaded.engine_stats["compiles"] == 0 and loaded.engine_stats["kept"]
        assert torch.equal(loaded.sequences, out.sequences)
        assert torch._dynamo.config.enable_aot_compile is False  # only while compiling and loading
    assert torch._dynamo.config.enable_aot_compile is default
