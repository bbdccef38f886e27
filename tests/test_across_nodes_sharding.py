"""Ranks of a role on two nodes (``LOCAL_WORLD_SIZE`` 2 of ``WORLD_SIZE`` 4) in a real gloo group:
HSDP shards within a node and replicates across, and CPU replicas average across nodes with the
group's all-reduce, never a shared-memory segment (which another host could not map)."""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn
from resilient_rl.testing.ranks import join_gloo, run_ranks

WORLD, LOCAL = 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _data(rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).view(2, 4) * (rank + 1) / 10


def _rank(rank: int, port: int, out) -> None:
    from resilient_rl.workers import fsdp

    join_gloo(rank, port, WORLD, LOCAL)  # a rank of a pool of [2, 2]: two nodes of two
    try:
        # HSDP: a (replicate, shard) mesh, one row per node; one SGD step on this rank's data.
        model = fsdp.wrap_model(_model(), fsdp.plan_device("cpu", sharding="hybrid"), "fsdp")
        weight = next(model.parameters())
        mesh = (tuple(weight.device_mesh.shape), weight.device_mesh.mesh_dim_names,
                [type(p).__name__ for p in weight.placements])
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(_data(rank)).square().mean().backward()
        opt.step()
        hsdp = {k: v.tolist() for k, v in fsdp.full_state_dict(model).items()}
        # The colocated weight sync gathers HSDP shards within the node's row of the mesh.
        from resilient_rl.workers.weight_sync import write_into

        synced = {k: torch.empty(len(v), *torch.tensor(v).shape[1:]) for k, v in hsdp.items()}
        write_into(model, synced)
        assert all(torch.equal(synced[k], torch.tensor(v)) for k, v in hsdp.items())
        # Replicas across nodes: gradients averaged by all-reduce, no shared-memory reducer opened.
        replica = fsdp.wrap_model(_model(), fsdp.plan_device("cpu"), "ddp")
        replica(_data(rank)).square().mean().backward()
        fsdp.all_reduce_gradients(replica)
        grads = [p.grad.tolist() for p in replica.parameters()]
        out.put((rank, mesh, hsdp, grads, fsdp.spans_one_node(), len(fsdp._REDUCERS._reducers)))
    finally:
        dist.destroy_process_group()


def test_hybrid_sharding_and_replicas_across_two_nodes():
    got = run_ranks(_rank, WORLD, timeout_s=180)
    # The reference: one model, the mean of the four ranks' losses (data parallelism's gradient).
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = [ref(_data(r)).square().mean() for r in range(WORLD)]
    (sum(losses) / WORLD).backward()
    mean_grads = [p.grad.clone() for p in ref.parameters()]
    opt.step()
    for rank in range(WORLD):
        mesh, hsdp, grads, one_node, reducers = got[rank]
        assert mesh == ((2, 2), ("replicate", "shard"), ["Replicate", "Shard"])
        for name, value in ref.state_dict().items():
            assert torch.allclose(torch.tensor(hsdp[name]), value, atol=1e-6), name
        for g, want in zip(grads, mean_grads):
            assert torch.allclose(torch.tensor(g), want, atol=1e-6)
        assert not one_node and reducers == 0
    assert all(got[r][2] == got[0][2] for r in range(WORLD)), "every rank holds the same averaged bits"
