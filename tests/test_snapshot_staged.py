"""A packed snapshot written through two staging buffers (workers/snapshots/staged.py), the path a
pageable copy takes into GPU tensors: on this CPU the same windows and copies run with host
destinations and pageable buffers (page-locking and the device's asynchronous copies need CUDA).
Every tensor comes back bit for bit, whatever the window size against the tensors' sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resilient_rl.workers.snapshots import buffers as snapshot_buffers
from resilient_rl.workers.snapshots.buffers import Layout, copy_in
from resilient_rl.workers.snapshots.staged import staged_copy, wants_staging


def state() -> list[tuple[str, torch.Tensor]]:
    """Tensors of the kinds a rank's state holds: fp32 and bf16 weights of several sizes, a 0-dim
    fp32 step count, an int64 buffer, a bool buffer, an empty tensor."""
    g = torch.Generator().manual_seed(0)
    return [("model/embed", torch.randn(37, 16, generator=g)),
            ("model/norm", torch.randn(16, generator=g).to(torch.bfloat16)),
            ("model/empty", torch.empty(0, 4)),
            ("model/positions", torch.arange(29, dtype=torch.int64)),
            ("model/mask", torch.rand(13, generator=g) > 0.5),
            ("optim/embed/step", torch.tensor(7.0)),
            ("optim/embed/exp_avg", torch.randn(37, 16, generator=g)),
            ("optim/embed/exp_avg_sq", torch.rand(37, 16, generator=g))]


def packed(tensors) -> tuple[Layout, np.ndarray]:
    layout = Layout.of(tensors)
    data = np.zeros(layout.total, dtype=np.uint8)
    for view, (_, t) in zip(layout.views(torch.from_numpy(data)), tensors):
        view.copy_(t)
    return layout, data


@pytest.mark.parametrize("stage_bytes", [64, 100, 1000, 2368, 1 << 20])
def test_every_tensor_comes_back_bit_for_bit_whatever_the_window(stage_bytes):
    """Windows smaller than one tensor (a tensor spans several), not a multiple of the alignment,
    the size of the largest tensor, larger than the whole buffer."""
    want = state()
    layout, data = packed(want)
    dst = [torch.zeros_like(t) if t.dtype != torch.bool else torch.zeros(t.shape, dtype=torch.bool) for _, t in want]
    dst[0] = torch.nn.Parameter(dst[0])  # a restore writes the model's parameters in place
    staged_copy(torch.from_numpy(data), [e.offset for e in layout.entries], dst, stage_bytes=stage_bytes)
    for (name, t), got in zip(want, dst):
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert dst[0].requires_grad and dst[0].grad_fn is None


def test_a_destination_that_is_not_contiguous_is_written_too():
    want = state()
    layout, data = packed(want)
    dst = [torch.zeros_like(t) for _, t in want]
    dst[0] = torch.zeros(16, 37).t()  # the embedding's destination: a transposed view
    staged_copy(torch.from_numpy(data), [e.offset for e in layout.entries], dst, stage_bytes=256)
    assert torch.equal(dst[0], want[0][1])
    assert all(torch.equal(got, t) for (_, t), got in zip(want[1:], dst[1:]))


def test_copy_in_through_the_stages_is_the_direct_copy(monkeypatch):
    """``copy_in`` takes the staged path where asked (on a GPU: a pageable copy into its tensors),
    with the layout's checks first, and reports progress per window."""
    from resilient_rl.runtime import progress

    want = state()
    layout, data = packed(want)
    direct = [(n, torch.zeros_like(t)) for n, t in want]
    copy_in(layout, data, direct, staged=False)
    monkeypatch.setattr("resilient_rl.workers.snapshots.staged.STAGE_BYTES", 512)
    through = [(n, torch.zeros_like(t)) for n, t in want]
    before = progress.snapshot().advances
    snapshot_buffers.copy_in(layout, data, through, staged=True)
    assert progress.snapshot().advances - before == -(-layout.total // 512)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(direct, through))
    with pytest.raises(ValueError, match="optim/embed/step"):
        copy_in(layout, data, [(n, t) for n, t in through if n != "optim/embed/step"], staged=True)


def test_only_a_pageable_copy_into_gpu_tensors_is_staged():
    flat = torch.zeros(8, dtype=torch.uint8)
    assert not wants_staging(flat, [torch.zeros(2)])  # host tensors: a memory copy either way
    if torch.cuda.is_available():
        assert wants_staging(flat, [torch.zeros(2, device="cuda")])
        assert not wants_staging(flat.pin_memory(), [torch.zeros(2, device="cuda")])


def test_offsets_must_fit_the_tensors():
    with pytest.raises(ValueError, match="2 offsets for 1 tensors"):
        staged_copy(torch.zeros(8, dtype=torch.uint8), [0, 4], [torch.zeros(1)])
    with pytest.raises(ValueError, match="ascend"):
        staged_copy(torch.zeros(8, dtype=torch.uint8), [4, 0], [torch.zeros(1), torch.zeros(1)])
