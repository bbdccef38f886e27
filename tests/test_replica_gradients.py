"""Gradients of ``ddp`` replicas (workers/fsdp.py: all_reduce_gradients) in a real 2-rank gloo group."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from resilient_rl.workers.fsdp import all_reduce_gradients, plan_device, wrap_model
from resilient_rl.runtime.master_env import free_port


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        model = wrap_model(_model(), plan_device("cpu"), "ddp")
        x = torch.full((1, 3), float(rank + 1))
        # Rank 1 leaves the second layer out of its graph: that layer has no gradient there.
        loss = model(x).sum() if rank == 0 else model[0](x).sum()
        loss.backward()
        all_reduce_gradients(model)
        # Plain lists: a tensor put on the queue lives in its sender's shared memory, gone with it.
        out.put((rank, [p.grad.tolist() for p in model.parameters()]))
    finally:
        dist.destroy_process_group()


def test_replicas_average_their_gradients_and_a_missing_one_counts_as_zero():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        grads = {rank: [torch.tensor(g) for g in got] for rank, got in (out.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = []
    for rank in range(2):
        model = _model()
        x = torch.full((1, 3), float(rank + 1))
        (model(x).sum() if rank == 0 else model[0](x).sum()).backward()
        expected.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected)]
    for rank in range(2):
        assert len(grads[rank]) == len(mean)
        for got, want in zip(grads[rank], mean):
            assert torch.allclose(got, want, atol=1e-6)
    # Every rank holds the same bits, so the replicas stay identical after the optimizer step.
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_without_a_process_group_gradients_are_left_alone():
    model = _model()
    model(torch.ones(1, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    all_reduce_gradients(model)  # no process group: nothing to average
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("strategy,device,expected", [("auto", "cpu", "ddp"), ("auto", "cuda", "fsdp"),
                                                      ("fsdp", "cpu", "fsdp"), ("ddp", "cuda", "ddp")])
def test_strategy_resolution(strategy, device, expected):
    from resilient_rl.workers.fsdp import resolve_strategy

    assert resolve_strategy(strategy, torch.device(device)) == expected
