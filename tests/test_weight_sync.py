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


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_buckets_pack_and_unpack_uneven_shards_of_every_rank(world):
    """What an all-gather does, done by hand: every rank packs its Shard(0) chunks into its segment."""
    gen = torch.Generator().manual_seed(world)
    full = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(2, generator=gen), "c": torch.randn(7, 2, 2, generator=gen),
            "d": torch.randn(1, 4, generator=gen)}
    buckets = weight_sync.plan_buckets([(k, tuple(v.shape)) for k, v in full.items()], world, 4, bucket_bytes=64)
    assert len(buckets) > 1 and [n for b in buckets for n in b.names] == list(full)
    out = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    for bucket in buckets:
        recv = torch.full((bucket.numel,), float("nan"))
        for rank in range(world):
            shards = []
            for name in bucket.names:
                chunks = full[name].chunk(world)
                shards.append(chunks[rank] if rank < len(chunks) else full[name][:0])
            bucket.pack(shards, rank, recv[rank * bucket.width:(rank + 1) * bucket.width])
        bucket.unpack(recv, out)
    for name in full:
        assert torch.equal(out[name], full[name]), name
