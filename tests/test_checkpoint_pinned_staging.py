"""Checkpoint staging of a GPU state page-locks one host buffer of the state's exact size.

``torch.empty(..., pin_memory=True)`` per tensor went through torch's caching host allocator, which
rounds each block up to a power of two: up to twice the state's size in locked host memory (19 GB
lock 32 GB), a quarter more on average. Staging now carves its pinned buffers out of one pageable
allocation of their packed size, registered with CUDA (``resilient_rl.page_lock``, shared with
the snapshot ring).

This machine has no GPU, so CUDA's side is faked and nothing else: ``torch.cuda.cudart()`` is a
:class:`~resilient_rl.testing.fake_cudart.FakeCudart` that records each registration, and
``torch.cuda.is_available()`` says True. The state whose buffers are sized is made of fake CUDA
tensors (``FakeTensorMode``: metadata only, which is all sizing reads); where a state is copied,
CPU tensors stand in for CUDA ones. The host memory is allocated, written and read for real.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from resilient_rl import page_lock
from resilient_rl.checkpoint import AsyncShardWriter, Storage, load_shard_into, stage, write_shard
from resilient_rl.checkpoint import sharded
from resilient_rl.testing.fake_cudart import FakeCudart

#: Sizes far from powers of two, and dtypes of different widths.
SHAPES = {"model/w": ((1000, 37), torch.float32), "model/b": ((37,), torch.float32),
          "model/emb": ((333, 5), torch.bfloat16), "optim/step": ((), torch.float32)}


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(page_lock, "loaded_runtimes", lambda: [fake])
    return fake


def _nested(flat: dict) -> dict:
    """``{"model/w": t}`` as the state ``{"model": {"w": t}}`` whose flat keys they are."""
    out: dict = {}
    for key, value in flat.items():
        part, name = key.split("/")
        out.setdefault(part, {})[name] = value
    return out


def _cuda_state() -> dict:
    with FakeTensorMode():
        return _nested({key: torch.empty(shape, dtype=dtype, device="cuda") for key, (shape, dtype) in SHAPES.items()})


def _cpu_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return _nested({key: torch.randn(shape, generator=g).to(dtype) for key, (shape, dtype) in SHAPES.items()})


def _packed_bytes() -> int:
    return page_lock.packed_size(list(SHAPES.values()))[1]


def _one_storage(staged) -> torch.UntypedStorage:
    storages = {st.data.untyped_storage().data_ptr(): st.data.untyped_storage() for st in staged.tensors.values()}
    assert len(storages) == 1, "the pinned buffers are not views of one allocation"
    return next(iter(storages.values()))


def test_preallocated_staging_of_a_cuda_state_page_locks_its_exact_size_once(cudart):
    state = _cuda_state()
    spec = sharded.staging_spec(state, 0)
    assert all(b.pinned for b in spec.values())  # a CUDA source on a CUDA machine: pinned buffers
    with AsyncShardWriter() as writer:
        writer.preallocate(state, 0).result()
        buffers = writer.buffers
    raw = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    total = _packed_bytes()
    assert raw <= total < raw + page_lock.ALIGN * len(SHAPES)  # torch's allocator: 2**18 for model/w alone
    assert [size for _, size, _ in cudart.registered] == [total]
    storage = _one_storage(buffers)
    assert storage.nbytes() == total and cudart.registered[0][0] == storage.data_ptr()
    for key, (shape, dtype) in SHAPES.items():
        data = buffers.tensors[key].data
        assert (tuple(data.shape), data.dtype, data.device.type) == (shape, dtype, "cpu")
        assert buffers.tensors[key].pinned

    again = sharded.allocate_staging(spec, 0, 1, reuse=buffers)  # what fits is kept, not locked again
    assert {k: t.data.data_ptr() for k, t in again.tensors.items()} == \
        {k: t.data.data_ptr() for k, t in buffers.tensors.items()}
    assert len(cudart.registered) == 1
    del buffers, again, storage, data
    gc.collect()
    assert cudart.registered == []  # unlocked once the last view is gone, before the memory is freed


def test_staging_copies_into_one_pinned_buffer_and_reuses_it(cudart, monkeypatch, tmp_path):
    monkeypatch.setattr(sharded, "_pinned", lambda t: True)  # the CPU tensors stand in for CUDA ones
    first = stage(_cpu_state(1), 0, world_size=1)
    assert [size for _, size, _ in cudart.registered] == [_packed_bytes()]
    ptrs = {k: t.data.data_ptr() for k, t in first.tensors.items()}
    assert _one_storage(first).nbytes() == _packed_bytes()

    state = _cpu_state(2)
    second = stage(state, 0, world_size=1, reuse=first)
    assert {k: t.data.data_ptr() for k, t in second.tensors.items()} == ptrs and len(cudart.registered) == 1
    storage = Storage(str(tmp_path))
    records = write_shard(second, storage, "step", 0)
    template = _nested({key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in SHAPES.items()})
    loaded = load_shard_into(template, storage, "step", records, rank=0)
    for key in SHAPES:
        part, name = key.split("/")
        assert torch.equal(loaded[part][name], state[part][name]), key


def test_a_refused_page_lock_leaves_pageable_staging_buffers_that_are_reused(cudart, monkeypatch):
    cudart.code = 2  # cudaErrorMemoryAllocation: more than the node lets this process lock
    monkeypatch.setattr(sharded, "_pinned", lambda t: True)
    first = stage(_cpu_state(1), 0, world_size=1)
    assert cudart.registered == [] and cudart.last_error == 0  # refused, and its CUDA error consumed
    assert all(t.pinned for t in first.tensors.values())
    cudart.code = 0  # not asked again: the save keeps its pageable buffers rather than reallocating
    second = stage(_cpu_state(2), 0, world_size=1, reuse=first)
    assert {k: t.data.data_ptr() for k, t in second.tensors.items()} == \
        {k: t.data.data_ptr() for k, t in first.tensors.items()}
    assert cudart.registered == []
