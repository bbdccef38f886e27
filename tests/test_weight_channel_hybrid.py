"""Split placement with ``trainer.sharding=hybrid`` across two (simulated) nodes: the actor's four
ranks shard over their node's two (HSDP) and rank 0 broadcasts the gathered weights over the
weight channel (gloo) to a rollout process of its own, which lays its buckets out for the layout
the actor reports (``layout_world``: the shard group, 2, not the world, 4). The rollout ends with
the actor's weights bit for bit."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from resilient_rl.runtime.master_env import free_port
from resilient_rl.testing.ranks import join_gloo

WORLD, LOCAL = 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Uneven rows (5, 7, 3) so that shards of 2 and of 4 ranks lay buckets out differently.
    return nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 7), nn.Linear(7, 3))


def _actor(rank: int, port: int, channel_port: int, out) -> None:
    from resilient_rl.workers import fsdp, weight_channel, weight_sync

    join_gloo(rank, port, WORLD, LOCAL)  # a rank of a pool of [2, 2]: two nodes of two
    try:
        model = fsdp.wrap_model(_model(), fsdp.plan_device("cpu", sharding="hybrid"), "fsdp")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(torch.full((2, 4), 0.1 * (rank + 1))).square().mean().backward()
        opt.step()
        full = {k: v.clone() for k, v in fsdp.full_state_dict(model).items()}
        layout = weight_sync.layout_world(model)
        if rank == 0:
            weight_channel.join(1, "127.0.0.1", channel_port, 0, 2, "gloo", 60.0)
            out.put(("layout", layout))
        weight_channel.send(model, torch.float32, is_root=rank == 0)
        if rank == 0:
            out.put(("actor", {k: v.tolist() for k, v in full.items()}))
            weight_channel.close()
    finally:
        dist.destroy_process_group()


def _rollout(channel_port: int, layout_q, out) -> None:
    torch.set_num_threads(1)
    from resilient_rl.workers import weight_channel

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    weight_channel.join(1, "127.0.0.1", channel_port, 1, 2, "gloo", 60.0)
    weight_channel.receive(model, layout_q.get(timeout=120))
    out.put(("rollout", {k: v.tolist() for k, v in model.state_dict().items()}))
    weight_channel.close()


def test_split_hybrid_weight_sync_delivers_the_actor_weights_bit_for_bit():
    ctx = mp.get_context("spawn")
    out, layout_q = ctx.Queue(), ctx.Queue()
    port, channel_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    procs = [ctx.Process(target=_actor, args=(r, port, channel_port, out)) for r in range(WORLD)]
    procs.append(ctx.Process(target=_rollout, args=(channel_port, layout_q, out)))
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < 3:
            kind, value = out.get(timeout=180)
            got[kind] = value
            if kind == "layout":
                layout_q.put(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got["layout"] == LOCAL  # the shard group of a node's row, not the world
    assert got["rollout"].keys() == got["actor"].keys()
    for name, weights in got["actor"].items():
        assert torch.equal(torch.tensor(got["rollout"][name]), torch.tensor(weights)), name
