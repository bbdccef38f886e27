"""A resume with a changed config is checked against the resumed checkpoint before anything is written.

The runs here are written by :class:`~resilient_rl.testing.run_folder.FakeRun` (committed
checkpoints holding the trainer state and config, no training); Ray is never started: a refused
resume must stop before it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from resilient_rl.cli import main
from resilient_rl.config.resume import RESUME_MAY_CHANGE, check_resume_config, may_change_on_resume
from resilient_rl.config.schema import config_to_dict, load_config, redacted_config_dict
from resilient_rl.errors import ConfigError
from resilient_rl.testing.run_folder import FakeRun, tree_state
from resilient_rl.trainer.resume_check import check_resume


def _args(run: FakeRun, base) -> list[str]:
    return [f"trainer.run_name={run.name}", f"trainer.output_dir={base / 'runs'}", f"checkpoint.root={base / 'ckpt'}",
            f"trainer.total_steps={run.total_steps}", f"checkpoint.save_every={run.save_every}"]


@pytest.fixture
def no_ray(monkeypatch):
    """A resume refused for its config must not get as far as the cluster."""
    import resilient_rl.runtime.cluster as cluster

    def refuse(*_a, **_k):
        raise AssertionError("the cluster was started")
    monkeypatch.setattr(cluster, "connect", refuse)


@pytest.mark.parametrize("config_in_checkpoint", [True, False])
def test_a_resume_changing_the_model_is_refused_before_anything_is_written(tmp_path, capsys, no_ray,
                                                                           config_in_checkpoint):
    # Without a config in the checkpoint (an older version's), the run's config.yaml stands in.
    run = FakeRun(tmp_path, total_steps=12, save_every=3, record_config=config_in_checkpoint)
    run.train(6)
    before = {p: tree_state(p) for p in (run.path, tmp_path / "ckpt")}
    assert main(["-q", "train", *_args(run, tmp_path), "model.hidden_size=128", "actor.ppo_epochs=2"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size: 64 -> 128" in err and "actor.ppo_epochs: 4 -> 2" in err
    assert "step_00000006" in err and "checkpoint.resume=off" in err
    assert "corrupt" not in err.lower() and "Traceback" not in err
    assert {p: tree_state(p) for p in before} == before


def test_a_newest_step_that_cannot_be_read_does_not_let_a_changed_model_through(tmp_path, capsys, no_ray):
    """The restore falls back from an unreadable newest step to an older one: the check does too,
    and refuses the changed model against it, before anything is written."""
    run = FakeRun(tmp_path, total_steps=12, save_every=3)
    run.train(6)
    state = run.manager.storage.full_path(f"{run.name}/step_00000006/trainer_state.json")
    with open(state, "r+b") as f:
        f.write(b"{{{")
    before = {p: tree_state(p) for p in (run.path, tmp_path / "ckpt")}
    assert main(["-q", "train", *_args(run, tmp_path), "model.hidden_size=128"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size: 64 -> 128" in err and "step_00000003" in err
    assert {p: tree_state(p) for p in before} == before


def test_a_resume_changing_allowed_keys_warns_naming_them(tmp_path, caplog):
    run = FakeRun(tmp_path, total_steps=12, save_every=3)
    run.train(6)
    cfg = load_config(None, [*_args(run, tmp_path), "trainer.total_steps=40", "actor.optim.lr=0.001",
                             "checkpoint.keep_last=5"])
    with caplog.at_level(logging.WARNING):
        accepted = check_resume(cfg, run.manager, run.path, "new-digest")
    assert accepted == run.manager.load_manifest(6).config_digest
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1, warning
    assert "actor.optim.lr, checkpoint.keep_last, trainer.total_steps" in warning[0]


def test_an_unchanged_or_fresh_run_is_not_checked(tmp_path, caplog):
    run = FakeRun(tmp_path, total_steps=12, save_every=3)
    cfg = load_config(None, [*_args(run, tmp_path), "model.hidden_size=128"])
    assert check_resume(cfg, run.manager, run.path, "x") is None  # nothing committed yet
    run.train(3)
    off = load_config(None, [*_args(run, tmp_path), "model.hidden_size=128", "checkpoint.resume=off"])
    assert check_resume(off, run.manager, run.path, "x") is None  # starting over
    same = load_config(None, _args(run, tmp_path))
    from resilient_rl.config.schema import config_digest

    with caplog.at_level(logging.WARNING):
        assert check_resume(same, run.manager, run.path, config_digest(same)) is None
    assert not caplog.records


def test_which_keys_may_change():
    assert may_change_on_resume("trainer.total_steps") and may_change_on_resume("checkpoint.keep_last")
    assert may_change_on_resume("ray.num_cpus") and may_change_on_resume("checkpoint.storage_options.key")
    assert may_change_on_resume("actor.world_size") and may_change_on_resume("critic.strategy")
    for key in ("model.hidden_size", "actor.mini_batch_size", "actor.optim.betas", "data.seed", "trainer.seed",
                "algorithm.adv_estimator", "rollout.n", "rollout.temperature", "trainer.totals"):
        assert not may_change_on_resume(key), key
    # Every entry names a real key or section of the config.
    flat = config_to_dict(load_config())
    for key in RESUME_MAY_CHANGE:
        node = flat
        for part in key.split("."):
            node = node[part]


@pytest.mark.parametrize("override", ["trainer.preempt_grace_s=300", "rollout.compile=true"])
def test_a_resume_may_change_how_long_a_preemption_save_takes_and_whether_decode_compiles(tmp_path, caplog,
                                                                                        override):
    """Neither key changes what a step computes or saves: a grace period for the preemption save,
    and whether the rollout's decode step is compiled (as ``actor.compile`` already may)."""
    run = FakeRun(tmp_path, total_steps=12, save_every=3)
    run.train(6)
    cfg = load_config(None, [*_args(run, tmp_path), override])
    with caplog.at_level(logging.WARNING):
        assert check_resume(cfg, run.manager, run.path, "new-digest") == run.manager.load_manifest(6).config_digest
    assert override.split("=")[0] in caplog.text


def test_a_saved_config_of_an_older_version_lacks_keys_that_are_then_defaults():
    new = redacted_config_dict(load_config())
    saved = redacted_config_dict(load_config())
    del saved["rollout"]["cuda_graphs"]
    assert check_resume_config(saved, new, "here") == []
    saved["model"]["num_layers"] = 3
    with pytest.raises(ConfigError, match=r"changed model.num_layers: 3 -> 2: "):
        check_resume_config(saved, new, "here")


def test_a_loaded_schedule_keeps_this_runs_learning_rate():
    """A resume that changes optim.lr trains on the new rate from its first step; an unchanged
    one gets exactly the saved rate (a resumed run stays bit-identical)."""
    from resilient_rl.config.schema import OptimConfig
    from resilient_rl.workers.rank_state import load_schedule
    from resilient_rl.workers.optimizer import build_optimizer, build_scheduler

    def engine(lr: float):
        model = torch.nn.Linear(2, 2)
        optim_cfg = OptimConfig(lr=lr, warmup_steps=4, schedule="cosine")
        optimizer = build_optimizer(model, optim_cfg)
        return optimizer, build_scheduler(optimizer, optim_cfg, total_steps=20)

    optimizer, scheduler = engine(3e-3)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    saved_lr, state = optimizer.param_groups[0]["lr"], scheduler.state_dict()

    same_opt, same = engine(3e-3)
    same_opt.load_state_dict(optimizer.state_dict())
    load_schedule(same, state)
    assert same_opt.param_groups[0]["lr"] == saved_lr and same.get_last_lr() == [saved_lr]

    new_opt, new = engine(1e-3)
    new_opt.load_state_dict(optimizer.state_dict())
    load_schedule(new, state)
    assert new.last_epoch == 7 and new.base_lrs == [1e-3]
    assert new_opt.param_groups[0]["lr"] == pytest.approx(saved_lr / 3)
    new_opt.step()
    new.step()
    assert new_opt.param_groups[0]["lr"] < 1e-3
