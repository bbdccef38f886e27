"""Token-sized micro-batches on an FSDP2 group: every rank runs as many micro-batches as its
peers (each forward and backward is a collective), however its rows split (2 gloo ranks)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from resilient_rl.testing.ranks import run_ranks
from resilient_rl.workers import micro_batch

VOCAB = 16
PROMPT, RESP = 8, 2


def test_cut_to_splits_the_largest_range_until_the_count_is_reached():
    assert micro_batch.cut_to([(0, 4)], 3) == [(0, 1), (1, 2), (2, 4)]
    assert micro_batch.cut_to([(0, 1), (1, 4)], 2) == [(0, 1), (1, 4)]  # already there
    assert micro_batch.cut_to([(0, 2)], 5) == [(0, 1), (1, 2)]  # no more rows to cut


def _batch(rank: int):
    """Rank 0: four full rows (one micro-batch each at 10 tokens); rank 1: four 3-token rows (two)."""
    from resilient_rl.protocol import DataProto

    g = torch.Generator().manual_seed(11 + rank)
    rows = 4
    ids = torch.randint(3, VOCAB, (rows, PROMPT + RESP), generator=g)
    mask = torch.ones_like(ids)
    if rank == 1:
        mask[:, :PROMPT - 1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                "responses": ids[:, PROMPT:], "response_mask": torch.ones(rows, RESP),
                                "old_log_probs": -2.5 + 0.1 * torch.randn(rows, RESP, generator=g),
                                "advantages": torch.randn(rows, RESP, generator=g),
                                "values": 0.1 * torch.randn(rows, RESP, generator=g),
                                "returns": torch.randn(rows, RESP, generator=g)}, meta_info={"seed": 1})


def _rank(rank: int, port: int, out) -> None:
    from resilient_rl.config.schema import config_from_dict
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine
    from resilient_rl.workers.value import ValueEngine

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    # A finite timeout: ranks out of step in their collectives fail the test instead of hanging it.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        got = {}
        for budget in (10, None):
            cfg = config_from_dict({"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                              "intermediate_size": 64, "max_seq_len": 16},
                                    "actor": {"mini_batch_size": 8, "ppo_epochs": 1, "strategy": "fsdp",
                                              "micro_batch_tokens": budget, "optim": {"warmup_steps": 0}},
                                    "critic": {"mini_batch_size": 8, "ppo_epochs": 1, "strategy": "fsdp",
                                               "micro_batch_tokens": budget, "optim": {"warmup_steps": 0}}})
            engine = PolicyEngine(cfg.model, VOCAB, 0, plan_device("cpu"), actor_cfg=cfg.actor)
            data = _batch(rank)
            logp = engine.compute_log_prob(data).batch["log_probs"]
            metrics = engine.update(data, step=0)
            critic = ValueEngine(cfg.model, cfg.critic, VOCAB, 1, plan_device("cpu"))
            values = critic.compute_values(data).batch["values"]
            critic_metrics = critic.update(data, step=0)
            got[budget] = (logp.tolist(), metrics["actor/grad_norm"], values.tolist(), critic_metrics["critic/grad_norm"])
        out.put((rank, micro_batch.count(_batch(rank).batch["attention_mask"], 10), got))
    except BaseException as exc:
        out.put((rank, None, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def test_ranks_that_split_differently_run_as_many_micro_batches():
    """Actor and critic: log-prob, value and update passes finish on both ranks and equal the
    unsplit passes within float rounding."""
    results = run_ranks(_rank, 2, timeout_s=180)
    assert {rank: n for rank, (n, _) in results.items()} == {0: 4, 1: 2}, results
    for rank, (_, got) in results.items():
        assert isinstance(got, dict), got
        split, whole = got[10], got[None]
        for i in (0, 2):  # actor log-probs, critic values
            torch.testing.assert_close(torch.tensor(split[i]), torch.tensor(whole[i]), rtol=1e-5, atol=1e-6)
        for i in (1, 3):  # actor and critic gradient norms (global over the group)
            assert abs(split[i] - whole[i]) <= 1e-5 * abs(whole[i]), (rank, i, split[i], whole[i])
