"""``micro_batch_tokens=auto`` (workers/memory_plan.py): the update pass sized from the device's
memory, the model's shape and the precision, and the decision printed in one line at start."""

from __future__ import annotations

import logging

import pytest
import torch

from resilient_rl.config.schema import config_from_dict, load_config
from resilient_rl.errors import ConfigError
from resilient_rl.workers import memory_plan as mp
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.value import ValueEngine

GB = 10**9
BF16_AUTOCAST = mp.Precision.of(2, fsdp=False)   # one GPU: fp32 weights, bf16 autocast
BF16_FSDP = mp.Precision.of(2, fsdp=True)        # FSDP2 casts the gathered parameters to bf16


def test_activation_bytes_per_token_and_layer_follow_the_documented_formula():
    # 30 h + 8 i + 4 heads under bf16 autocast (the rough figures: ~73 KB and ~116 KB).
    assert mp.layer_bytes_per_token(mp.QWEN25_05B, BF16_AUTOCAST) == 30 * 896 + 8 * 4864 + 4 * 14 == 65_848
    assert mp.layer_bytes_per_token(mp.QWEN25_15B, BF16_AUTOCAST) == 30 * 1536 + 8 * 8960 + 4 * 12 == 117_808
    # FSDP2's bf16 parameters keep a bf16 residual stream: 26 h + 8 i + 4 heads.
    assert mp.layer_bytes_per_token(mp.QWEN25_15B, BF16_FSDP) == 26 * 1536 + 8 * 8960 + 4 * 12
    # Grouped-query attention read in the kernel instead of repeat_kv keeps K/V at their width.
    assert mp.layer_bytes_per_token(mp.QWEN25_15B, BF16_AUTOCAST, expanded_kv=False) \
        == 117_808 - 2 * 2 * (1536 - 256)


def test_qwen_shapes_count_their_published_parameters():
    assert mp.QWEN25_05B.parameter_count() == 494_032_768
    assert mp.QWEN25_15B.parameter_count() == 1_543_714_304


@pytest.mark.parametrize("tied", [True, False])
def test_the_shape_of_a_built_hf_model_counts_what_it_holds(tied):
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from resilient_rl.models.factory import build_causal_lm, build_value_model

    cfg = SimpleNamespace(kind="hf", path=None, hf_config={
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
        "max_position_embeddings": 64, "tie_word_embeddings": tied})
    model = build_causal_lm(cfg, 64, seed=0)
    shape = mp.ModelShape.from_config(model.config)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab, shape.tied) \
        == (2, 32, 48, 4, 2, 64, tied)
    assert shape.parameter_count() == mp.model_parameters(model)
    critic = build_value_model(cfg, 64, seed=0)
    assert mp.ModelShape.from_config(critic.config, value_head=True).parameter_count() == mp.model_parameters(critic)


@pytest.mark.parametrize("shape, ranks, prec", [
    (mp.QWEN25_15B, 1, BF16_AUTOCAST),
    (mp.QWEN25_15B, 8, BF16_FSDP),
    (mp.QWEN25_05B, 1, BF16_AUTOCAST),
])
def test_a_128_by_768_token_mini_batch_is_split_to_fit_80_gb(shape, ranks, prec):
    plan = mp.plan(shape, role="actor", device_bytes=80 * GB, device="80 GB GPU", prec=prec, shard_ranks=ranks,
                   mini_batch_rows=128 // ranks, seq_len=768)
    whole = 128 // ranks * 768
    if ranks == 1:  # one device: ~170 GB (0.5 B) / ~320 GB (1.5 B) of activations unsplit
        assert plan.peak_at(whole) > 80 * GB
    if plan.tokens is None:
        assert plan.peak_bytes <= plan.budget_bytes
        return
    assert plan.fits and plan.tokens < whole and plan.tokens % mp.ROUND_TO == 0
    assert plan.peak_bytes == plan.peak_at(plan.tokens) <= plan.budget_bytes < 80 * GB
    assert plan.peak_at(plan.tokens + mp.ROUND_TO) > plan.budget_bytes  # the largest that fits


def test_the_1_5b_plan_on_one_80_gb_gpu():
    plan = mp.plan(mp.QWEN25_15B, role="actor", device_bytes=80 * GB, device="80 GB GPU", prec=BF16_AUTOCAST,
                   shard_ranks=1, mini_batch_rows=128, seq_len=768)
    assert plan.tokens is not None and plan.tokens < 128 * 768 and plan.peak_bytes <= 80 * GB
    # Checkpointing keeps a layer's input only: the whole mini-batch fits in one forward.
    ckpt = mp.plan(mp.QWEN25_15B, role="actor", device_bytes=80 * GB, device="80 GB GPU", prec=BF16_AUTOCAST,
                   shard_ranks=1, mini_batch_rows=128, seq_len=768, checkpointing=True)
    assert ckpt.tokens is None and ckpt.peak_bytes <= ckpt.budget_bytes
    # Colocated roles (ref weights, rollout weights and KV cache, a critic) leave less room.
    busy = mp.plan(mp.QWEN25_15B, role="actor", device_bytes=80 * GB, device="80 GB GPU", prec=BF16_AUTOCAST,
                   shard_ranks=1, mini_batch_rows=128, seq_len=768, other_bytes=mp.colocated_bytes(
                       mp.QWEN25_15B, BF16_AUTOCAST, 1, ("ref", "rollout"), kv_rows=128, seq_len=768))
    assert busy.tokens < plan.tokens and busy.peak_bytes <= 80 * GB
    assert plan.line.startswith(f"actor micro_batch_tokens=auto -> {plan.tokens} tokens (74.5 GiB 80 GB GPU, ")
    assert "117.8 KB/token/layer" in plan.line


def test_a_row_that_cannot_fit_is_said_so():
    plan = mp.plan(mp.QWEN25_15B, role="actor", device_bytes=40 * GB, device="40 GB GPU", prec=BF16_AUTOCAST,
                   shard_ranks=1, mini_batch_rows=4, seq_len=8192)
    assert plan.tokens == 8192 and not plan.fits
    assert "activation_checkpointing=true" in plan.line


def test_summary_is_one_line_for_the_roles_that_asked():
    assert mp.summary([None, None]) is None
    assert mp.summary(["actor a", None, "critic c"]) == "memory plan: actor a; critic c"


# ---------------------------------------------------------------------------------------------- config


def test_config_accepts_auto_an_int_or_null_and_names_the_key_of_junk():
    cfg = config_from_dict({})
    assert cfg.actor.micro_batch_tokens == "auto" and cfg.critic.micro_batch_tokens == "auto"
    assert load_config(None, ["actor.micro_batch_tokens=4096"]).actor.micro_batch_tokens == 4096
    assert load_config(None, ["critic.micro_batch_tokens=null"]).critic.micro_batch_tokens is None
    for bad in ("junk", "0", "-3", "1.5", "true"):
        key = "critic.micro_batch_tokens" if bad == "0" else "actor.micro_batch_tokens"
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}={bad}"])


# ---------------------------------------------------------------------------------------------- engines

VOCAB = 20


def _cfg(**actor):
    return config_from_dict({"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                                       "max_seq_len": 16},
                             "actor": {"mini_batch_size": 8, **actor}, "critic": {"mini_batch_size": 8}})


def test_auto_on_cpu_keeps_one_forward_per_mini_batch():
    cfg = _cfg()
    actor = PolicyEngine(cfg.model, VOCAB, 1, plan_device("cpu"), actor_cfg=cfg.actor)
    assert actor.micro_batch_tokens is None and actor.memory_plan.tokens is None
    assert actor.memory_plan.line.startswith("actor micro_batch_tokens=auto -> null (one forward per mini-batch) (")
    assert "host memory" in actor.memory_plan.line
    critic = ValueEngine(cfg.model, cfg.critic, VOCAB, 2, plan_device("cpu"))
    assert critic.micro_batch_tokens is None and critic.memory_plan.role == "critic"
    ref = PolicyEngine(cfg.model, VOCAB, 1, plan_device("cpu"), trainable=False)
    assert ref.micro_batch_tokens is None and ref.memory_plan is None


@pytest.mark.parametrize("value", [24, None])
def test_a_value_set_by_hand_wins(value):
    cfg = _cfg(micro_batch_tokens=value)
    engine = PolicyEngine(cfg.model, VOCAB, 1, plan_device("cpu"), actor_cfg=cfg.actor)
    assert engine.micro_batch_tokens == value and engine.memory_plan is None


def test_auto_splits_where_the_device_is_small(monkeypatch):
    cfg = _cfg()
    big = PolicyEngine(cfg.model, VOCAB, 1, plan_device("cpu"), actor_cfg=cfg.actor).memory_plan
    # A device with room for the fixed part and about 40 tokens of activations.
    monkeypatch.setattr(mp, "HEADROOM", 0.0)
    monkeypatch.setattr(mp, "RESERVED_BYTES", 0)
    monkeypatch.setattr(mp, "device_memory", lambda device: (big.fixed_bytes + 40 * big.token_bytes, "small"))
    engine = PolicyEngine(cfg.model, VOCAB, 1, plan_device("cpu"), actor_cfg=cfg.actor)
    assert engine.micro_batch_tokens == 32  # whole rows of max_seq_len=16
    assert engine.memory_plan.peak_bytes <= engine.memory_plan.budget_bytes


def test_the_plan_is_printed_once_at_start(tmp_path, caplog):
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, ["trainer.total_steps=1", "data.batch_size=4", "actor.mini_batch_size=4",
                             "critic.mini_batch_size=4", f"trainer.output_dir={tmp_path}",
                             f"checkpoint.root={tmp_path}/ckpt", "trainer.progress_bar=false"])
    trainer = PPOTrainer(cfg)
    with caplog.at_level(logging.INFO, logger="resilient_rl.trainer.local_roles"):
        roles = LocalRoles(cfg, trainer.tokenizer)
        roles.init_models()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan: ")]
    assert len(lines) == 1
    assert lines[0].startswith("memory plan: actor micro_batch_tokens=auto -> null (one forward per mini-batch) (")
    assert "; critic micro_batch_tokens=auto -> " in lines[0] and "\n" not in lines[0]


def test_a_plan_that_cannot_fit_is_announced_as_a_warning(caplog):
    tight = mp.plan(mp.QWEN25_15B, role="actor", device_bytes=40 * GB, device="40 GB GPU", prec=BF16_AUTOCAST,
                    shard_ranks=1, mini_batch_rows=4, seq_len=8192)
    log = logging.getLogger("test.memory_plan")
    with caplog.at_level(logging.INFO, logger="test.memory_plan"):
        assert mp.announce(log, [tight.line, None]).startswith("memory plan: actor micro_batch_tokens=auto -> 8192")
        mp.announce(log, [None])  # nobody asked for auto: nothing is said
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_the_module_prints_the_workloads_plans(capsys):
    mp.main(["--device-gb", "80", "--rows", "128", "--seq-len", "768"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["Qwen2.5-0.5B", "Qwen2.5-1.5B"]
    assert out[1].startswith("Qwen2.5-1.5B: 117808 bytes/token/layer; memory plan: actor micro_batch_tokens=auto -> ")


def test_the_logit_chunk_is_the_log_prob_heads():
    from resilient_rl.workers import logprob

    assert mp.CHUNK_ELEMENTS == logprob._CHUNK_ELEMENTS


def test_the_allocators_account_of_an_update_pass(monkeypatch):
    """On a GPU the update pass reports the allocator's peaks and its cudaMalloc retries during the
    pass beside the plan's peak (CUDA's counters faked here: CPU has none); on CPU, nothing."""
    from resilient_rl.workers.allocator import AllocatorWindow

    stats = {"num_alloc_retries": 3, "allocated_bytes.all.peak": 10, "reserved_bytes.all.peak": 12}
    resets = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    window = AllocatorWindow(torch.device("cuda", 0))
    assert resets == [torch.device("cuda", 0)]
    stats.update({"num_alloc_retries": 5, "allocated_bytes.all.peak": 70 * 2**30, "reserved_bytes.all.peak": 75 * 2**30})
    assert window.metrics("actor", planned_peak=68 * 2**30) == {
        "perf/actor_peak_bytes": 70.0 * 2**30, "perf/actor_reserved_peak_bytes": 75.0 * 2**30,
        "perf/actor_alloc_retries": 2.0, "perf/actor_planned_peak_bytes": 68.0 * 2**30}
    assert "perf/critic_planned_peak_bytes" not in window.metrics("critic")
    assert AllocatorWindow(torch.device("cpu")).metrics("actor", 1) == {}


@pytest.mark.parametrize("given, sets, grows", [
    ({}, True, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, True, True),  # other settings: kept, and set beside
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False, False),  # the user's choice stands
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8, expandable_segments:True"}, False, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, False, False),  # not the caching allocator
    ({"PYTORCH_ALLOC_CONF": "  ", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:false"}, False, False),
])
def test_a_gpu_worker_lets_the_allocator_grow_its_segments_unless_the_environment_says(monkeypatch, given, sets,
                                                                                         grows):
    """torch's setter faked (a CPU build has no CUDA allocator to change): the setting is applied
    once per process, and never over the environment's own choice of segments or backend."""
    from resilient_rl import env
    from resilient_rl.workers import allocator

    for name in env.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(allocator, "_DECIDED", [])
    applied: list[str] = []
    assert allocator.grow_segments_in_place(applied.append) is grows
    assert allocator.grow_segments_in_place(applied.append) is grows  # once per process
    assert applied == (["expandable_segments:True"] if sets else [])


def test_an_allocator_that_refuses_the_setting_keeps_its_own(monkeypatch, caplog):
    from resilient_rl import env
    from resilient_rl.workers import allocator

    for name in env.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_DECIDED", [])

    def refuse(setting):
        raise RuntimeError("Unrecognized key 'expandable_segments'")

    assert allocator.grow_segments_in_place(refuse) is False
    assert "could not be set to grow its segments in place (RuntimeError: Unrecognized key" in caplog.text
    assert callable(allocator._torch_setter())  # this torch has the call the default setter makes
