"""A tied Hugging Face model (Qwen2 ties its LM head to the input embedding) built empty and
sharded by FSDP2 over 2 gloo ranks: after ``to_empty`` each rank's head is tied again
(workers/fsdp.py:materialize), loads a full state, computes the unsharded model's logits and
gets the unsharded model's gradient for the one shared matrix (both of its uses summed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from resilient_rl.testing.ranks import run_ranks

VOCAB = 64
QWEN2_TIED = SimpleNamespace(kind="hf", path=None, hf_config={
    "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "tie_word_embeddings": True,
})


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _rank(rank: int, port: int, out) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from resilient_rl.models.factory import build_causal_lm
    from resilient_rl.workers.fsdp import plan_device, wrap_fsdp2

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ref = build_causal_lm(QWEN2_TIED, VOCAB, seed=3)
        model = wrap_fsdp2(build_causal_lm(QWEN2_TIED, VOCAB, seed=3, empty=True), plan_device("cpu"))
        head, embed = model.lm_head.weight, model.get_input_embeddings().weight
        tied = head is embed and type(head).__name__ == "DTensor"
        count = len(list(model.parameters()))
        set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
        logits = model(_ids()).logits
        logits.float().pow(2).mean().backward()
        grad = model.get_input_embeddings().weight.grad.full_tensor()
        out.put((rank, tied, count, logits.tolist(), grad.tolist()))
    except BaseException as exc:  # say why on the queue instead of leaving the test to time out
        out.put((rank, repr(exc), None, None, None))
        raise
    finally:
        dist.destroy_process_group()


def test_tied_embeddings_are_tied_again_on_every_rank_after_to_empty():
    pytest.importorskip("transformers")
    from resilient_rl.models.factory import build_causal_lm

    got = run_ranks(_rank, 2, timeout_s=240)
    ref = build_causal_lm(QWEN2_TIED, VOCAB, seed=3)
    assert ref.lm_head.weight is ref.get_input_embeddings().weight
    logits = ref(_ids()).logits
    logits.float().pow(2).mean().backward()
    for rank in range(2):
        tied, count, rank_logits, grad = got[rank]
        assert tied is True, f"rank {rank}: {tied}"
        assert count == len(list(ref.parameters()))  # the shared matrix is one parameter
        torch.testing.assert_close(torch.tensor(rank_logits), logits.detach(), rtol=1e-5, atol=1e-6)
        # Same batch on both ranks: the averaged gradient is the unsharded one, both uses summed.
        torch.testing.assert_close(torch.tensor(grad), ref.get_input_embeddings().weight.grad,
                                   rtol=1e-5, atol=1e-7)
