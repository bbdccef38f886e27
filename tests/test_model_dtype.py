"""``model.dtype``: the compute dtype of the trained roles, with fp32 master weights and optimizer
state (FSDP2's mixed-precision policy for a sharded model, autocast for a replica)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resilient_rl.config.schema import config_from_dict
from resilient_rl.errors import ConfigError
from resilient_rl.protocol import DataProto
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.runtime.master_env import free_port

VOCAB = 16


def _cfg(**actor):
    return config_from_dict({"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                                       "max_seq_len": 16},
                             "actor": {"mini_batch_size": 4, "ppo_epochs": 1, **actor}})


def _batch(rows: int = 4, prompt: int = 4, resp: int = 3) -> DataProto:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (rows, prompt + resp), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    resp_mask = torch.ones(rows, resp)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                "responses": ids[:, prompt:], "response_mask": resp_mask,
                                "old_log_probs": torch.full((rows, resp), -2.5),
                                "advantages": torch.randn(rows, resp, generator=g)}, meta_info={"seed": 1})


def _compute_dtypes(engine) -> list[torch.dtype]:
    """The dtypes of the blocks' linear layers' outputs during a log-prob pass."""
    seen: list[torch.dtype] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
             for m in engine.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    try:
        engine.compute_log_prob(_batch())
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_dtype_is_validated_and_named():
    assert _cfg().model.dtype == "auto"
    with pytest.raises(ConfigError, match=r"model.dtype='float16'.*'auto', 'float32', 'bfloat16'"):
        config_from_dict({"model": {"dtype": "float16"}})
    with pytest.raises(ConfigError, match="model.dtype"):
        plan_device("cpu", "fp16")


def test_a_cuda_plan_keeps_attention_off_cudnn_and_lets_the_allocator_grow_its_segments(monkeypatch):
    """No GPU here: torch.cuda answers as on one. A CUDA plan turns off SDPA's cuDNN kernels, whose
    backward failed in a 1.5 B update on an H200, and lets the caching allocator grow its segments
    in place; a CPU plan leaves both alone."""
    from resilient_rl.workers import fsdp

    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    monkeypatch.setattr(fsdp, "grow_segments_in_place", lambda: calls.append("expandable"))
    calls: list = []
    plan_device("cpu", "auto")
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    plan = plan_device("cuda", "auto")
    assert calls == [False, "expandable"] and plan.device == torch.device("cuda", 0)
    assert plan.param_dtype == torch.bfloat16


def test_auto_is_fp32_on_cpu_and_bfloat16_mixes():
    auto = plan_device("cpu", "auto")
    assert (auto.param_dtype, auto.reduce_dtype, auto.mixed_precision) == (torch.float32, torch.float32, False)
    bf16 = plan_device("cpu", "bfloat16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.mixed_precision) == (torch.bfloat16, torch.float32, True)


def test_bf16_replica_computes_in_bf16_with_fp32_master_weights_and_optimizer_state():
    cfg = _cfg()
    fp32 = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu", "float32"), actor_cfg=cfg.actor)
    bf16 = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu", "bfloat16"), actor_cfg=cfg.actor)
    assert set(_compute_dtypes(fp32)) == {torch.float32}
    assert set(_compute_dtypes(bf16)) == {torch.bfloat16}
    lp32 = fp32.compute_log_prob(_batch()).batch["log_probs"]
    lp16 = bf16.compute_log_prob(_batch()).batch["log_probs"]
    assert lp16.dtype == torch.float32 and not torch.equal(lp16, lp32)  # really computed differently
    assert torch.allclose(lp16, lp32, atol=0.05)
    metrics = bf16.update(_batch(), step=0)
    assert metrics["actor/grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    state = [s for s in bf16.optimizer.state.values() if s]
    assert state and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
                         for s in state)


def _fsdp_rank(rank: int, port: int, out) -> None:
    import resilient_rl.workers.logprob as logprob

    torch.set_num_threads(1)
    # Several chunks, so that the backward pass recomputes chunk logits from the root's gathered
    # parameters; checkpointed blocks recompute inside their FSDP units; packed rows.
    logprob._CHUNK_ELEMENTS = VOCAB * 3
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        cfg = _cfg(strategy="fsdp", activation_checkpointing=True, packing=True, micro_batch_tokens=12)
        engine = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu", "bfloat16"), actor_cfg=cfg.actor)
        dtypes = _compute_dtypes(engine)
        metrics = engine.update(_batch(), step=0)
        state = [s for s in engine.optimizer.state.values() if s]
        out.put((rank, sorted({str(d) for d in dtypes}),
                 sorted({str(p.to_local().dtype) for p in engine.model.parameters()}),
                 sorted({str(s["exp_avg"].to_local().dtype) for s in state}), metrics["actor/grad_norm"]))
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_keep_fp32_while_blocks_compute_in_bf16():
    """Two gloo ranks, FSDP2 with bf16 compute, with the update-pass options on."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, compute, params, optim, grad_norm in results:
        assert compute == ["torch.bfloat16"], rank
        assert params == ["torch.float32"] and optim == ["torch.float32"], rank
        assert grad_norm > 0


def test_a_bf16_rollout_keeps_the_actors_positional_encodings():
    """A bf16 rollout casts its weights, not its rotary frequencies: rounded to bf16 they turn each
    position by an angle that grows with it, and the rollout would sample from other positional
    encodings than the actor (fp32 weights under autocast) scores its tokens with."""
    from resilient_rl.models.factory import build_causal_lm
    from resilient_rl.workers.rollout import RolloutEngine

    qwen2 = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 1024, "rope_theta": 1000000.0, "tie_word_embeddings": True}
    cfg = config_from_dict({"model": {"kind": "hf", "hf_config": qwen2}})
    rollout = RolloutEngine(cfg.model, cfg.rollout, 64, 0, plan_device("cpu", "bfloat16"), eos_token_id=1,
                            pad_token_id=0).model
    actor = build_causal_lm(cfg.model, 64, 0)
    assert {p.dtype for p in rollout.parameters()} == {torch.bfloat16}
    assert rollout.lm_head.weight is rollout.model.embed_tokens.weight  # still tied
    positions = torch.arange(776)[None]
    x = torch.zeros(1, 776, 64, dtype=torch.bfloat16)
    ours = rollout.model.rotary_emb(x, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = actor.model.rotary_emb(x.float(), positions)
    for a, b in zip(ours, theirs):  # cos, sin: equal up to their rounding to bf16
        assert (a.float() - b.float()).abs().max() <= 2**-8, (a.float() - b.float()).abs().max()
