"""A replica under bf16 autocast hands its RMS norms' and rotary embedding's outputs on in bf16
(resilient_rl/models/precision.py), as FSDP2's mixed precision has them: the same products, fewer
and narrower elementwise passes, gradients within bf16 rounding of before, nothing changed outside
autocast."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from resilient_rl.models.hf import load_hf_causal_lm
from resilient_rl.models.precision import hand_on_in_autocast_dtype

CONFIG = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "max_position_embeddings": 256, "tie_word_embeddings": True}
IDS = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))


class _Written(TorchDispatchMode):
    """Bytes of activations (tensors with the token dimension) written per operator."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and IDS.shape[1] in t.shape:
                    self.bytes[func.overloadpacket.__name__] += t.numel() * t.element_size()
        return out


def run(hooked: bool, autocast: bool = True):
    """Loss, parameter gradients, the dtypes the attention got and the bytes written, of one
    forward and backward."""
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config=CONFIG)
    if hooked:
        assert hand_on_in_autocast_dtype(model) == 2 * 2 + 1 + 1  # two norms a layer, the final one, rotary
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["position_embeddings"][0].dtype), with_kwargs=True)
    written = _Written()
    with written, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=IDS, use_cache=False).logits.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, seen, written.bytes


def test_under_autocast_norms_and_rotary_hand_on_bf16_and_the_gradients_stay_within_rounding():
    loss, grads, seen, written = run(hooked=False)
    h_loss, h_grads, h_seen, h_written = run(hooked=True)
    assert seen == [torch.float32] and h_seen == [torch.bfloat16]  # cos/sin as the attention gets them
    torch.testing.assert_close(h_loss, loss, rtol=1e-2, atol=1e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(h_grads[name], grad, rtol=0.1, atol=2e-3, msg=name)
    # Fewer casts, narrower rotary arithmetic: fewer activation bytes written outside the products.
    products = {"mm", "addmm", "bmm", "embedding", "embedding_dense_backward"}
    outside = lambda counts: sum(v for k, v in counts.items() if k not in products)  # noqa: E731
    assert h_written["_to_copy"] < written["_to_copy"] and outside(h_written) < 0.95 * outside(written)


def test_outside_autocast_the_hooks_change_nothing():
    loss, grads, seen, _ = run(hooked=False, autocast=False)
    h_loss, h_grads, h_seen, _ = run(hooked=True, autocast=False)
    assert seen == h_seen == [torch.float32] and torch.equal(loss, h_loss)
    assert all(torch.equal(h_grads[n], g) for n, g in grads.items())


def test_a_replica_engine_under_autocast_is_hooked_and_an_fp32_one_is_not(tmp_path):
    import yaml

    from resilient_rl.config.schema import load_config
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"kind": "hf", "hf_config": CONFIG}, "trainer": {"device": "cpu"}}))

    def hooks(dtype: str) -> int:
        cfg = load_config(str(path), [f"model.dtype={dtype}"])
        engine = PolicyEngine(cfg.model, 128, 0, plan_device("cpu", dtype), actor_cfg=cfg.actor, total_steps=1)
        return sum(len(m._forward_hooks) for m in engine.model.modules()
                   if type(m).__name__.endswith(("RMSNorm", "RotaryEmbedding")))

    assert hooks("bfloat16") == 6 and hooks("float32") == 0
