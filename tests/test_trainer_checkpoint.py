"""Checkpoints through the trainer: stop and resume bit-exact, resume on other world sizes."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.config.schema import load_config
from resilient_rl.events import read_events
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.run.folder import deterministic_view
from resilient_rl.recovery.rollback import AFTER_FAILURE

pytestmark = pytest.mark.ray

SMALL = ["trainer.progress_bar=false", "data.batch_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
         "data.num_prompts=64", "checkpoint.save_every=2", "ray.cpus_per_worker=0.05"]


def cfg(tmp_path, name, *extra):
    return load_config(None, SMALL + [f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                                      f"trainer.run_name={name}", *extra])


def strategy(name: str) -> tuple[str, str]:
    return f"actor.strategy={name}", f"critic.strategy={name}"


def actor_weights(trainer) -> dict[str, torch.Tensor]:
    return next(w for w in trainer.roles.groups["actor"].full_weights() if w is not None)


def fit(c) -> tuple[PPOTrainer, dict]:
    t = PPOTrainer(c)
    try:
        t.fit()
        return t, actor_weights(t)
    finally:
        t.shutdown()


def test_stop_and_resume_is_bit_identical(ray_cluster, tmp_path):
    full, w_full = fit(cfg(tmp_path, "full", "trainer.total_steps=5"))
    first, _ = fit(cfg(tmp_path, "split", "trainer.total_steps=3"))  # stops after step 3 (saved: final step)
    resumed_cfg = cfg(tmp_path, "split", "trainer.total_steps=5")
    resumed, w_resumed = fit(resumed_cfg)
    restored = [e for e in read_events(resumed.run_dir.path) if e["event"] == "checkpoint_restored"]
    assert restored and restored[0]["step"] == 3
    assert deterministic_view(resumed.run_dir.read_metrics()) == deterministic_view(full.run_dir.read_metrics())
    assert w_full.keys() == w_resumed.keys()
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)


@pytest.mark.parametrize("world_size,saved_as,loaded_as", [(1, "fsdp", "ddp"),
                                                            pytest.param(4, "ddp", "fsdp", marks=pytest.mark.slow)])
def test_resume_on_another_world_size(ray_cluster, tmp_path, world_size, saved_as, loaded_as):
    """FSDP2 shards load into replicas, and replicas (written once, by rank 0) into 4 shards."""
    saved, w_saved = fit(cfg(tmp_path, "src", "trainer.total_steps=2", *strategy(saved_as)))
    step_dir = saved.ckpt.manager.step_dir(2)
    c = cfg(tmp_path, f"dst{world_size}", "trainer.total_steps=3", f"actor.world_size={world_size}",
            f"checkpoint.resume=path:{step_dir}", *strategy(loaded_as))
    t = PPOTrainer(c)
    try:
        t.start_roles()
        assert t.step == 2
        w_loaded = actor_weights(t)
        assert all(torch.equal(w_saved[k], w_loaded[k]) for k in w_saved), "resharded weights equal the saved ones"
        t.fit()
        assert [r["step"] for r in t.run_dir.read_metrics()] == [3]
        assert t.roles.groups["actor"].world_size == world_size
    finally:
        t.shutdown()


def test_resume_from_an_earlier_step_keeps_its_timeline(ray_cluster, tmp_path):
    _, w_first = fit(cfg(tmp_path, "timeline", "trainer.total_steps=4"))  # commits steps 2 and 4
    step_2 = f"{tmp_path}/ckpt/timeline/step_00000002"
    t = PPOTrainer(cfg(tmp_path, "timeline", "trainer.total_steps=4", f"checkpoint.resume=path:{step_2}"))
    try:
        t.start_roles()
        assert t.step == 2 and t.ckpt.manager.committed_steps() == [2], "step 4 was set aside"
        assert t.rollback.roll_back_to(t.roles, *AFTER_FAILURE) == 2, \
            "a recovery before the next commit keeps the resumed timeline"
        t.fit()
        assert [r["step"] for r in t.run_dir.read_metrics()] == [1, 2, 3, 4]
        w_again = actor_weights(t)
        assert all(torch.equal(w_first[k], w_again[k]) for k in w_first)
        assert t.ckpt.manager.load_manifest(4).fencing_token == 2  # the second controller's lease
    finally:
        t.shutdown()
    assert len(list((tmp_path / "ckpt" / "timeline" / "abandoned").glob("*/step_00000004"))) == 1
