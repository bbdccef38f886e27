"""A packed update reads nothing back from its device in its forward, loss and backward passes:
the rows are laid out on the host and moved without a wait (resilient_rl/workers/host_to_device.py),
the model takes that layout with an all-ones mask (resilient_rl/models/varlen_hf.py: transformers'
packed-rows check, which reads the positions back, does not run), and the log-prob head gathers and
scatters by integer indices. On a GPU each read-back waits for all the work queued before it, then
the device idles until the host has launched again. Counted here from a profile of the trainer's
own update on the CPU, by the phase of the update the operator ran in (bench/device_idle.py)."""

from __future__ import annotations

import collections

import pytest
import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from resilient_rl.protocol import DataProto

CONFIG = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "max_position_embeddings": 256, "tie_word_embeddings": True}
READBACKS = ("aten::nonzero", "aten::_local_scalar_dense")
ON_DEVICE = ("actor.forward", "logprob.head", "actor.loss", "actor.backward")


@pytest.fixture
def device_idle(monkeypatch):
    from resilient_rl.testing.bench_scripts import BENCH

    monkeypatch.syspath_prepend(str(BENCH))
    import device_idle

    return device_idle


def _engine_and_batch(tmp_path):
    from resilient_rl.config.schema import load_config
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"kind": "hf", "hf_config": CONFIG}, "trainer": {"device": "cpu"},
                                    "actor": {"packing": True, "micro_batch_tokens": 160, "use_kl_loss": True,
                                              "mini_batch_size": 8}}))
    cfg = load_config(str(path))
    engine = PolicyEngine(cfg.model, 128, 0, plan_device("cpu", "float32"), actor_cfg=cfg.actor, total_steps=4)
    g = torch.Generator().manual_seed(0)
    rows, prompt, response = 8, 12, 24
    cols = torch.arange(prompt + response)
    p_len = torch.randint(4, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(6, response + 1, (rows,), generator=g)
    mask = ((cols >= prompt - p_len[:, None]) & (cols < prompt + r_len[:, None])).long()
    ids = torch.randint(1, 128, (rows, prompt + response), generator=g) * mask
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": ids[:, prompt:],
                                "response_mask": mask[:, prompt:].clone()})
    logp = engine.compute_log_prob(data).batch["log_probs"]
    data.batch["old_log_probs"], data.batch["ref_log_prob"] = logp, logp
    data.batch["advantages"] = torch.randn(logp.shape, generator=g)
    return engine, data


def test_a_packed_update_reads_nothing_back_in_its_forward_loss_and_backward(tmp_path, device_idle):
    engine, data = _engine_and_batch(tmp_path)
    engine.update(data, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        metrics = engine.update(data, 2)
    assert metrics["actor/nonfinite_skipped"] == 0
    events = list(prof.events())
    phases = device_idle.phase_ranges(events)
    assert sum(1 for *_, name in phases if name == "actor.forward") >= 2  # micro-batches
    by_phase = collections.Counter()
    for e in events:
        if e.name in READBACKS:
            by_phase[device_idle.innermost(phases, (e.time_range.start + e.time_range.end) / 2)] += 1
    assert not {p: n for p, n in by_phase.items() if p in ON_DEVICE}, by_phase
    assert by_phase["logprob.pack"] > 0  # the layout, found on the host's tensors
    # One read-back per mini-batch beside them: whether its gradient norm is finite (all ranks step or skip).
    assert by_phase["actor.clip"] == sum(1 for *_, name in phases if name == "actor.clip")
