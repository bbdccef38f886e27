"""NaN and Inf never reach a checkpoint: worker-side skips, rewards, the KL controller, commit
refusal, retention of the newest known-good checkpoint and the trainer's nonfinite policy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from resilient_rl.algos.kl import AdaptiveKLController, apply_kl_penalty
from resilient_rl.checkpoint import CheckpointManager, FileRecord, Storage, step_dirname
from resilient_rl.checkpoint.manifest import Manifest
from resilient_rl.errors import CheckpointCorruptError, ConfigError, NonFiniteError
from resilient_rl.events import make_event, read_events
from resilient_rl.faults.nonfinite import NonFiniteAdvantage, NonFiniteReward
from resilient_rl.protocol import DataProto
from resilient_rl.testing.local_group import local_roles
from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
from resilient_rl.config.schema import config_from_dict, load_config
from resilient_rl.recovery.nonfinite import find_nonfinite
from resilient_rl.workers.checkpointing import state_is_finite
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.value import ValueEngine

TINY = {"kind": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64}
VOCAB = 16


def _cfg(tmp_path=None, **sections):
    data = {"model": TINY, "trainer": {"device": "cpu", "total_steps": 4},
            "actor": {"mini_batch_size": 2, "ppo_epochs": 1}, "critic": {"mini_batch_size": 2, "ppo_epochs": 1}}
    if tmp_path is not None:
        data["checkpoint"] = {"root": str(tmp_path / "ckpt"), "save_every": 1, "keep_last": 1}
        data["trainer"]["output_dir"] = str(tmp_path / "runs")
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return config_from_dict(data)


def _batch(engine: PolicyEngine, n: int = 4, prompt: int = 3, resp: int = 4) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (n, prompt + resp), generator=g)
    data = DataProto.from_dict({
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(prompt + resp).expand(n, -1).clone(),
        "responses": ids[:, prompt:], "response_mask": torch.ones(n, resp)})
    data.batch["old_log_probs"] = engine.compute_log_prob(data).batch["log_probs"]
    data.batch["advantages"] = torch.randn(n, resp, generator=g)
    data.batch["values"] = torch.zeros(n, resp)
    data.batch["returns"] = torch.randn(n, resp, generator=g)
    return data


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _actor(cfg) -> PolicyEngine:
    return PolicyEngine(cfg.model, VOCAB, 1, plan_device("cpu"), actor_cfg=cfg.actor, total_steps=4)


# ---------------------------------------------------------------------------------- workers
def test_actor_skips_a_mini_batch_with_a_nan_advantage_and_applies_the_others():
    cfg = _cfg()
    engine = _actor(cfg)
    data = _batch(engine)
    data.batch["advantages"][0, 1] = math.nan  # one of the two mini-batches is poisoned
    metrics = engine.update(data, step=1)
    assert metrics["actor/nonfinite_skipped"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
    assert state_is_finite(engine.optimizer.state_dict())


def test_actor_with_every_mini_batch_poisoned_leaves_weights_and_optimizer_untouched():
    cfg = _cfg()
    engine = _actor(cfg)
    data = _batch(engine)
    data.batch["advantages"][:] = math.inf
    before = _params(engine.model)
    metrics = engine.update(data, step=1)
    assert metrics["actor/nonfinite_skipped"] == 2.0
    assert "actor/pg_loss" not in metrics  # no applied update to average
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    assert not engine.optimizer.state  # AdamW never stepped: its moments are not poisoned
    clean = engine.update(_batch(engine), step=2)  # and the next clean batch trains normally
    assert clean["actor/nonfinite_skipped"] == 0.0 and math.isfinite(clean["actor/pg_loss"])


def test_critic_skips_a_mini_batch_with_nan_returns():
    cfg = _cfg()
    critic = ValueEngine(cfg.model, cfg.critic, VOCAB, 2, plan_device("cpu"), total_steps=4)
    data = _batch(_actor(cfg))
    data.batch["returns"][3, 0] = math.nan
    metrics = critic.update(data, step=1)
    assert metrics["critic/nonfinite_skipped"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert all(torch.isfinite(p).all() for p in critic.model.parameters())


def test_state_is_finite_walks_nested_state():
    state = {"model": {"w": torch.ones(3)}, "optim": {"state": {0: {"exp_avg": torch.zeros(2), "step": torch.tensor(1)}},
                                                     "param_groups": [{"lr": 0.1}]}}
    assert state_is_finite(state)
    state["optim"]["state"][0]["exp_avg"][1] = math.inf
    assert not state_is_finite(state)


# ---------------------------------------------------------------------------------- KL
def test_adaptive_kl_ignores_a_nan_kl_and_its_state_loads_back():
    ctrl = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    ctrl.update(math.nan, 8)
    ctrl.update(math.inf, 8)
    assert ctrl.value == 0.1
    ctrl.update(0.1, 8)
    assert math.isfinite(ctrl.value) and ctrl.value > 0.1
    saved = json.loads(json.dumps(ctrl.state_dict(), allow_nan=False))  # strict JSON, as checkpoints save it
    other = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    other.load_state_dict(saved)
    assert other.value == ctrl.value


def test_apply_kl_penalty_reports_a_nonfinite_kl_and_keeps_beta():
    ctrl = AdaptiveKLController(0.2, target_kl=0.05, horizon=10)
    logp = torch.zeros(2, 3)
    logp[0, 0] = math.nan
    _, metrics = apply_kl_penalty(torch.zeros(2, 3), logp, torch.zeros(2, 3), torch.ones(2, 3), ctrl, "kl")
    assert metrics["actor/reward_kl_nonfinite"] == 1.0
    assert ctrl.value == 0.2
    _, metrics = apply_kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), ctrl)
    assert metrics["actor/reward_kl_nonfinite"] == 0.0


# ---------------------------------------------------------------------------------- checkpoints
def _commit(manager: CheckpointManager, step: int, known_good: bool) -> None:
    manager.begin_step(step)
    rel = Storage.join(manager.run_name, step_dirname(step), "actor")
    recs = []
    for suffix in (".safetensors", ".json"):
        rec = manager.storage.write_bytes_atomic(Storage.join(rel, f"shard_00000{suffix}"), b"x" * step)
        recs.append(FileRecord(f"shard_00000{suffix}", rec.size, rec.sha256))
    manager.commit(step, {"actor": recs}, {"actor": 1}, known_good=known_good)


def test_retention_keeps_the_newest_known_good_checkpoint(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=2)
    _commit(manager, 1, True)
    _commit(manager, 2, True)
    for step in (3, 4, 5):  # written after a NaN was met
        _commit(manager, step, False)
    assert manager.committed_steps() == [2, 4, 5]
    assert manager.newest_known_good() == 2
    _commit(manager, 6, True)
    assert manager.committed_steps() == [5, 6]


def test_manifest_records_known_good_and_reads_old_manifests():
    m = Manifest(step=3, files=(), world_sizes={"actor": 1}, known_good=False)
    assert Manifest.from_bytes(m.to_bytes(), "m").known_good is False
    old = json.loads(m.to_bytes())
    del old["known_good"]
    assert Manifest.from_bytes(json.dumps(old).encode(), "m").known_good is True
    old["known_good"] = "yes"
    with pytest.raises(CheckpointCorruptError, match="known_good"):
        Manifest.from_bytes(json.dumps(old).encode(), "m")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_with_nan_is_never_committed(tmp_path, async_save):
    cfg = _cfg(tmp_path, checkpoint={"async_save": async_save})
    events = []
    coord = CheckpointCoordinator(cfg, on_event=lambda kind, **f: events.append((kind, f)))
    engine = _actor(cfg)
    roles = local_roles(actor=engine)
    coord.save(roles, 1, {"step": 1}, "d")
    coord.wait(roles)
    assert coord.manager.committed_steps() == [1]
    with torch.no_grad():
        next(engine.model.parameters())[0] = math.nan
    coord.save(roles, 2, {"step": 2}, "d")
    coord.wait(roles)
    assert coord.manager.committed_steps() == [1] and coord.manager.latest_step() == 1
    assert ("checkpoint_refused", {"step": 2, "role": "actor",
                                   "reason": "the saved state of actor holds NaN or Inf"}) in events
    assert any(k == "nonfinite" and f["quantity"] == "checkpoint" and f["action"] == "refused" for k, f in events)
    with torch.no_grad():
        next(engine.model.parameters())[0] = 0.0
    coord.save(roles, 3, {"step": 3, "kl_ctrl": {"value": math.nan}}, "d")  # a NaN in the controller's state
    coord.wait(roles)
    assert coord.manager.committed_steps() == [1]
    coord.save(roles, 4, {"step": 4}, "d", known_good=False)
    coord.wait(roles)
    assert coord.manager.committed_steps() == [1, 4]  # keep_last=1, yet step 1 is the newest known good
    assert coord.manager.load_manifest(4).known_good is False
    assert coord.restorer._source("known_good")[1] == 1


# ---------------------------------------------------------------------------------- trainer
def test_find_nonfinite_names_quantities():
    assert find_nonfinite({"step": 1, "reward/mean": 0.5, "reward/nonfinite": 0.0}) == []
    found = find_nonfinite({"step": 1, "reward/nonfinite": 2.0, "actor/nonfinite_skipped": 1.0})
    assert [(f.quantity, f.role) for f in found] == [("reward", None), ("loss", "actor")]
    assert find_nonfinite({"step": 1, "critic/vf_loss": math.nan})[0].quantity == "metric"


def test_nonfinite_config_is_validated():
    with pytest.raises(ConfigError, match="nonfinite"):
        load_config(None, ["trainer.nonfinite=ignore"])
    with pytest.raises(ConfigError, match="max_nonfinite"):
        load_config(None, ["trainer.max_nonfinite=-1"])


def _local_trainer(tmp_path, hooks, *extra):
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, ["trainer.total_steps=3", "trainer.progress_bar=false", "data.batch_size=8",
                             "data.num_prompts=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                             "actor.ppo_epochs=1", "critic.ppo_epochs=1", "model.hidden_size=32",
                             "model.num_layers=1", "model.intermediate_size=64", "telemetry.enabled=false",
                             "trainer.device=cpu", "trainer.loggers=[jsonl]",
                             f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                             "trainer.run_name=local", *extra])
    return PPOTrainer(cfg, roles_factory=LocalRoles, hooks=list(hooks))


def _events(trainer, kind):
    return [e for e in read_events(trainer.run_dir) if e["event"] == kind]


def test_skip_policy_zeroes_nan_rewards_and_skips_nan_updates(tmp_path):
    reward, adv = NonFiniteReward(steps=[1]), NonFiniteAdvantage(steps=[2])
    trainer = _local_trainer(tmp_path, [reward, adv])
    rows = trainer.fit()
    assert [r["step"] for r in rows] == [1, 2, 3] and reward.fired == [1] and adv.fired == [2]
    assert rows[0]["reward/nonfinite"] == 8.0 and rows[0]["reward/mean"] == 0.0
    assert rows[1]["actor/nonfinite_skipped"] == 1.0 and rows[2]["actor/nonfinite_skipped"] == 0.0
    assert all(np.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    seen = [(e["step"], e["quantity"], e["action"]) for e in _events(trainer, "nonfinite")]
    assert seen == [(1, "reward", "zeroed"), (2, "loss", "skipped")]
    assert all(torch.isfinite(p).all() for p in trainer.roles.actor.model.parameters())
    trainer.shutdown()


def test_raise_policy_and_the_budget_stop_the_run_naming_step_and_quantity(tmp_path):
    trainer = _local_trainer(tmp_path / "a", [NonFiniteAdvantage(steps=[2])], "trainer.nonfinite=raise")
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss/actor.*trainer.nonfinite=raise"):
        trainer.fit()
    trainer.shutdown()
    trainer = _local_trainer(tmp_path / "b", [NonFiniteReward(steps=[1, 2, 3])], "trainer.max_nonfinite=1")
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite reward.*2 step\(s\) in a row"):
        trainer.fit()
    assert [e["action"] for e in _events(trainer, "nonfinite")] == ["zeroed", "raised"]
    trainer.shutdown()


def test_the_budget_counts_steps_in_a_row_and_refused_saves(tmp_path):
    trainer = _local_trainer(tmp_path, [], "trainer.max_nonfinite=1")
    guard = trainer.nonfinite
    assert guard.after_step({"step": 1, "reward/nonfinite": 1.0})
    assert guard.after_step({"step": 2, "reward/nonfinite": 0.0}) and guard.in_a_row == 0  # a clean step ends a row
    assert guard.after_step({"step": 3, "critic/nonfinite_skipped": 2.0})
    assert not guard.take_known_good(3) and guard.take_known_good(3)  # only the interval with the NaN
    guard.on_checkpoint_event(make_event("checkpoint_refused", step=3, role="critic", reason="non-finite"))
    with pytest.raises(NonFiniteError, match=r"step 4: non-finite loss/critic.*3 step\(s\) in a row"):
        guard.after_step({"step": 4, "critic/nonfinite_skipped": 1.0})
    trainer = _local_trainer(tmp_path / "rb", [], "trainer.nonfinite=rollback")
    with pytest.raises(NonFiniteError, match="rollback needs the Ray roles"):
        trainer.nonfinite.after_step({"step": 1, "actor/nonfinite_skipped": 1.0})
