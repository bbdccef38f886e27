"""Weight sync into a rollout in the same process (workers/weight_sync.py), without a process group."""

from __future__ import annotations

from types import SimpleNamespace

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
    sink = weight_sync.Sink(rollout)
    with pytest.raises(WorkerError, match="holds version None"):
        sink.take(1)
    nbytes = sink.push(actor, version=1)
    sink.take(1)
    with pytest.raises(WorkerError, match="asked for 2"):
        sink.take(2)
    assert nbytes == sum(p.numel() * 4 for p in rollout.parameters())
    for (name, a), (_, r) in zip(actor.named_parameters(), rollout.named_parameters()):
        assert torch.equal(a, r), name
        assert a.data_ptr() != r.data_ptr()  # a copy: the actor's next update must not leak in


def test_push_follows_the_actor_through_updates_restores_and_rebuilds():
    """A push pairs the actor's parameters with the sink's once; later pushes copy through the
    pairs, and still see an in-place update, a swapped ``.data`` (a restore) and a rebuilt model."""
    actor, rollout = _model(0), _model(1).requires_grad_(False)
    sink = weight_sync.Sink(rollout)
    sink.push(actor, version=1)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)
    actor.lm_head.weight.data = torch.full_like(actor.lm_head.weight, 3.0)
    sink.push(actor, version=2)
    for (name, a), (_, r) in zip(actor.named_parameters(), rollout.named_parameters()):
        assert torch.equal(a, r), name
    rebuilt = _model(2)
    assert sink.push(rebuilt, version=3) == sum(p.numel() * 4 for p in rollout.parameters())
    sink.take(3)
    assert all(torch.equal(a, r) for a, r in zip(rebuilt.parameters(), rollout.parameters()))


def test_an_fsdp2_actor_is_not_paired_so_a_push_after_a_gathering_forward_stays_right(single_rank_group):
    """FSDP2 registers its gathered parameters after a forward without backward (log-probs) and
    its shards again after the next backward: a push must follow whichever are registered."""
    from torch.distributed.fsdp import fully_shard

    actor, rollout = _model(0), _model(1).requires_grad_(False)
    fully_shard(actor)
    sink = weight_sync.Sink(rollout)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        actor(input_ids=ids)
    assert not hasattr(next(actor.parameters()), "to_local")  # gathered
    sink.push(actor, version=1)
    actor(input_ids=ids).logits.sum().backward()  # resharded after the backward
    with torch.no_grad():
        for p in actor.parameters():
            p.to_local().add_(1.0)
    sink.push(actor, version=2)
    full = {n: p.full_tensor() for n, p in actor.named_parameters()}
    for name, r in rollout.named_parameters():
        assert torch.equal(full[name], r), name


def test_push_casts_into_a_rollout_of_another_dtype():
    actor, rollout = _model(0), _model(1).to(torch.bfloat16).requires_grad_(False)
    assert weight_sync.Sink(rollout).push(actor, version=1) == sum(p.numel() * 2 for p in rollout.parameters())
    assert all(torch.equal(a.to(torch.bfloat16), r) for a, r in zip(actor.parameters(), rollout.parameters()))


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
    from resilient_rl.workers.weight_parts import WeightSender

    sender = WeightSender(lambda: SimpleNamespace(model=_model(0)), lambda: None, lambda: 0, lambda: None)
    with pytest.raises(WorkerError, match="no rollout"):
        sender.export_weights(1, colocated=True)


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


def test_the_actor_s_digest_in_the_rollout_s_dtype_is_the_rollout_s_copy_s():
    """On a GPU the actor keeps fp32 master weights and the rollout computes in bf16: a sync that
    arrived gives the rollout the actor's weights rounded to bf16, and the two digests must agree."""
    from resilient_rl.workers.weight_sync import digest

    torch.manual_seed(0)
    actor = {"w": torch.randn(4, 8), "b": torch.randn(8)}
    rollout = {k: v.to(torch.bfloat16) for k, v in actor.items()}
    assert digest(actor, torch.bfloat16) == digest(rollout)
    assert digest(actor) != digest(rollout)  # fp32 against its bf16 copy: not the same weights
    assert digest(actor, torch.float32) == digest(actor)
    rollout["b"][0] += 1
    assert digest(actor, torch.bfloat16) != digest(rollout)
