"""The compiled norms, rotary embedding and SwiGLU (resilient_rl/models/fused_elementwise.py) on a model sharded by
FSDP2 over 2 gloo ranks, as multi-GPU runs shard the trained roles: in fp32 and with FSDP2's
bf16 parameters (the norms' input and weight then both bf16), each rank computes the unsharded
eager model's logits and gets its gradients, the norms' weights among them, within rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from resilient_rl.testing.ranks import run_ranks
from test_tied_fsdp_ranks import QWEN2_TIED as QWEN2, VOCAB  # the tied Qwen2 FSDP2 shards there too

#: Gradients compared: a norm's weight, an MLP projection's, and the final norm's.
GRADS = ("model.layers.0.input_layernorm.weight", "model.layers.1.mlp.gate_proj.weight", "model.norm.weight")


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))


def _rank(rank: int, port: int, out, dtype: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from resilient_rl.models.factory import build_causal_lm
    from resilient_rl.models.fused_elementwise import compile_elementwise
    from resilient_rl.workers.fsdp import plan_device, wrap_fsdp2

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ref = build_causal_lm(QWEN2, VOCAB, seed=3)
        model = wrap_fsdp2(build_causal_lm(QWEN2, VOCAB, seed=3, empty=True), plan_device("cpu", dtype))
        replaced = compile_elementwise(model)  # after the wrap, as the engines do
        set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
        logits = model(_ids()).logits
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters() if n in GRADS}
        out.put((rank, replaced, logits.float().tolist(), grads))
    except BaseException as exc:  # say why on the queue instead of leaving the test to time out
        out.put((rank, repr(exc), None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_fsdp2_ranks_compute_the_eager_logits_and_gradients_through_the_compiled_norms_and_swiglu(dtype, tol):
    pytest.importorskip("transformers")
    from resilient_rl.models.factory import build_causal_lm

    got = run_ranks(_rank, 2, (dtype,), timeout_s=240)
    ref = build_causal_lm(QWEN2, VOCAB, seed=3)
    logits = ref(_ids()).logits
    logits.float().pow(2).mean().backward()
    params = dict(ref.named_parameters())
    for rank in range(2):
        replaced, rank_logits, grads = got[rank]
        # two norms a layer, the final one; the MLPs; the attention modules
        assert replaced == 2 * 2 + 1 + 2 + 2, f"rank {rank}: {replaced}"
        torch.testing.assert_close(torch.tensor(rank_logits), logits.detach(), rtol=tol, atol=tol)
        assert sorted(grads) == sorted(GRADS)
        for name in GRADS:  # same batch on both ranks: the averaged gradient is the unsharded one
            want = params[name].grad
            torch.testing.assert_close(torch.tensor(grads[name]), want, rtol=10 * tol,
                                       atol=tol * want.abs().max().item(), msg=f"rank {rank}: {name}")
