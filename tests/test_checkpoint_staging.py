"""Staging buffers allocated ahead of the first async save.

The first save of a run must stage into buffers that already exist (pinned host memory on GPU,
pre-faulted pages on CPU), and sizing them must not change training: AdamW has no state before
its first step, and asking ``get_optimizer_state_dict`` for it earlier runs a zero-learning-rate
step that AdamW counts. These tests run on CPU; pinned memory is only used for CUDA sources.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from resilient_rl.checkpoint import AsyncShardWriter, Storage, load_shard_into
from resilient_rl.checkpoint.sharded import allocate_staging, staging_spec
from resilient_rl.config.runtime import CheckpointConfig
from resilient_rl.workers.checkpointing import RankCheckpointer
from resilient_rl.workers.rank_state import RankState, states_of

#: The parts of a rank's state each rank saves its own of (the RNG).
RANK_LOCAL = RankState(types.SimpleNamespace()).rank_local()


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"state": {"w": {"exp_avg": torch.randn(64, 32, generator=g),
                                      "step": torch.tensor(3.0)}}},
            "rng": {"torch": torch.get_rng_state()}}


def _ptrs(staged) -> dict[str, int]:
    return {k: st.data.data_ptr() for k, st in staged.tensors.items()}


def test_spec_lists_the_buffers_stage_fills_without_copying():
    state = _state()
    spec = staging_spec(state, rank=0, rank_local=RANK_LOCAL)
    assert set(spec) == {"model/w", "model/b", "optim/state/w/exp_avg", "optim/state/w/step", "rng/torch"}
    assert spec["model/w"].shape == (64, 32) and spec["model/w"].dtype == torch.float32
    assert not any(b.pinned for b in spec.values())  # CPU sources are never pinned
    # Rank 1 writes no replicated plain tensor, only its rank-local ones.
    assert set(staging_spec(state, rank=1, rank_local=RANK_LOCAL)) == {"rng/torch"}


def test_first_save_stages_into_the_preallocated_buffers(tmp_path):
    state = _state()
    storage = Storage(str(tmp_path))
    with AsyncShardWriter() as writer:
        writer.preallocate(state, 0, rank_local=RANK_LOCAL).result()
        before = _ptrs(writer.buffers)
        writer.stage_and_submit(state, storage, "s1", 0, rank_local=RANK_LOCAL).result()
        assert _ptrs(writer.buffers) == before  # no buffer allocated by the save itself
    template = _state(seed=1)
    loaded = load_shard_into(template, storage, "s1", rank=0)
    for key in ("w", "b"):
        assert torch.equal(loaded["model"][key], state["model"][key])
    assert torch.equal(loaded["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"])


def test_model_first_then_optimizer_keeps_the_model_buffers(tmp_path):
    state = _state()
    with AsyncShardWriter() as writer:
        writer.preallocate({"model": state["model"]}, 0)
        writer.preallocate(state, 0, rank_local=RANK_LOCAL).result()  # queued behind the first
        full = writer.buffers
        assert set(full.tensors) == set(staging_spec(state, 0, rank_local=RANK_LOCAL))
        model_ptrs = {k: v for k, v in _ptrs(full).items() if k.startswith("model/")}
        # Allocating again with the same spec reuses every buffer.
        again = allocate_staging(staging_spec(state, 0, rank_local=RANK_LOCAL), 0, 1,
                                 rank_local=RANK_LOCAL, reuse=full)
        assert _ptrs(again) == _ptrs(full)
        writer.stage_and_submit(state, Storage(str(tmp_path)), "s1", 0, rank_local=RANK_LOCAL).result()
        assert {k: v for k, v in _ptrs(writer.buffers).items() if k.startswith("model/")} == model_ptrs


def test_a_failed_preallocation_leaves_the_save_to_allocate(tmp_path, monkeypatch):
    import resilient_rl.checkpoint.async_writer as aw

    def broken(*args, **kwargs):
        raise RuntimeError("no pinned memory left")

    monkeypatch.setattr(aw, "allocate_staging", broken)
    state = _state()
    with AsyncShardWriter() as writer:
        writer.preallocate(state, 0)
        writer.stage_and_submit(state, Storage(str(tmp_path)), "s1", 0).result()
        assert set(writer.buffers.tensors) >= {"model/w", "model/b"}


class _Engine:
    """A role's engine: model, AdamW and schedule (what a RankCheckpointer saves)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)

    def update(self, seed: int) -> None:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        self.model(x).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()


class _Role:
    """Rank 0 of 1 of a role: its engine and the checkpointer handed its state, as a worker has."""

    def __init__(self, **checkpoint) -> None:
        c = CheckpointConfig(**checkpoint)
        self.engine = _Engine()
        self.checkpointer = RankCheckpointer(lambda: states_of(self.engine), lambda: (0, 1, None), "actor",
                                             staging=c.async_save and c.save_every > 0)


def test_preparing_before_the_first_step_does_not_change_training():
    prepared, plain = _Role(), _Role()
    try:
        assert prepared.checkpointer.prepare_staging()  # the model's buffers
        assert not prepared.engine.optimizer.state  # no zero-learning-rate step was run
        assert not prepared.checkpointer.prepare_staging()  # nothing new until the optimizer has state
        for step in range(3):
            prepared.engine.update(step)
            prepared.checkpointer.prepare_staging()
            plain.engine.update(step)
        for a, b in zip(prepared.engine.model.parameters(), plain.engine.model.parameters()):
            assert torch.equal(a, b)
        prepared.checkpointer._writer._take_prepared()
        keys = set(prepared.checkpointer._writer.buffers.tensors)
        optim = get_optimizer_state_dict(prepared.engine.model, prepared.engine.optimizer)
        assert any(k.startswith("optim/state/") and k.endswith("/exp_avg_sq") for k in keys)
        assert len([k for k in keys if k.startswith("optim/state/")]) == 3 * len(optim["state"])
        assert {f"model/{k}" for k in get_model_state_dict(prepared.engine.model)} <= keys
        assert prepared.checkpointer._staging_prepared == {"model", "optim"}
    finally:
        prepared.checkpointer.reset()


def test_nothing_is_allocated_when_saves_are_synchronous_or_off():
    for checkpoint in ({"async_save": False}, {"save_every": 0}):
        role = _Role(**checkpoint)
        role.engine.update(0)
        assert not role.checkpointer.prepare_staging()
        assert role.checkpointer._writer is None


def test_reset_after_a_recovery_keeps_the_buffers_for_the_next_writer():
    role = _Role()
    role.engine.update(0)
    role.checkpointer.prepare_staging()
    role.checkpointer.reset()  # a preallocation in progress is finished and kept, not dropped
    try:
        assert role.checkpointer._writer is not None and role.checkpointer._staging_prepared == frozenset()
        ptrs = _ptrs(role.checkpointer._writer.buffers)
        assert set(ptrs) == set(staging_spec(states_of(role.engine).checkpoint_state(), 0, rank_local=RANK_LOCAL))
        assert role.checkpointer.prepare_staging()  # re-sized against the kept buffers: all reused
        role.checkpointer._writer._take_prepared()
        assert _ptrs(role.checkpointer._writer.buffers) == ptrs
    finally:
        role.checkpointer._writer.close()
