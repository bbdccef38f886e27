"""Weight sync into a rollout in the same process (workers/weight_sync.py), without a process group."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.errors import WorkerError
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.workers import weight_sync


def _model(seed: int) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig(vocab_size=11, hidden_size=16, num_layers=2, num_heads=2,
                                     intermediate_size=32, max_seq_len=8))


@pytest.mark.parametrize("rows,world,expected", [(5, 2, [3, 2]), (4, 2, [2, 2]), (1, 3, [1, 0, 0]),
                                                 (7, 4, [2, 2, 2, 1]), (3, 4, [1, 1, 1, 0]), (0, 2, [0, 0])])
def test_shard_rows_follow_torch_chunk(rows, world, expected):
    assert weight_sync.shard_rows(rows, world) == expected
    if rows:
        chunks = [len(c) for c in torch.arange(rows).chunk(world)]
        assert expected[:len(chunks)] == chunks


def test_push_writes_the_actor_weights_into_the_registered_rollout():
    actor, rollout = _model(0), _model(1)
    weight_sync.register_sink(rollout)
    try:
        with pytest.raises(WorkerError, match="holds version None"):
            weight_sync.take(1)
        nbytes = weight_sync.push(actor, version=1)
        weight_sync.take(1)
        with pytest.raises(WorkerError, match="asked for 2"):
            weight_sync.take(2)
    finally:
        weight_sync.clear_sink()
    assert nbytes == sum(p.numel() * 4 for p in rollout.parameters())
    for (name, a), (_, r) in zip(actor.named_parameters(), rollout.named_parameters()):
        assert torch.equal(a, r), name
        assert a.data_ptr() != r.data_ptr()  # a copy: the actor's next update must not leak in


def test_write_into_casts_to_the_rollout_dtype_and_rejects_other_models():
    actor = _model(0)
    rollout = _model(1).to(torch.bfloat16)
    weight_sync.write_into(actor, dict(rollout.named_parameters()))
    for (name, a), (_, r) in zip(actor.named_parameters(), rollout.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), r), name
    other = TinyCausalLM(TinyLMConfig(vocab_size=11, hidden_size=16, num_layers=1, num_heads=2,
                                      intermediate_size=32, max_seq_len=8))
    with pytest.raises(WorkerError, match="parameters differ"):
        weight_sync.write_into(actor, dict(other.named_parameters()))


def test_push_without_a_rollout_in_the_process_is_an_error():
    weight_sync.clear_sink()
    with pytest.raises(WorkerError, match="no rollout"):
        weight_sync.push(_model(0), version=1)
