"""A refused controller writes nothing and starts nothing; the lease is keyed on the run folder
and on the checkpoint folder; ``checkpoint.takeover`` applies to the start that asked for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
import yaml

from resilient_rl.config.schema import load_config
from resilient_rl.errors import LeaseHeldError
from resilient_rl.trainer.ppo import PPOTrainer

_TINY = ["trainer.total_steps=2", "trainer.progress_bar=false", "data.batch_size=8", "data.num_prompts=16",
         "actor.mini_batch_size=8", "critic.mini_batch_size=8", "model.hidden_size=32", "model.num_layers=1",
         "model.intermediate_size=64", "checkpoint.save_every=1", "trainer.run_name=live"]


def _no_roles(cfg, tokenizer):
    raise AssertionError("a refused controller must not start workers")


_no_roles.writes_checkpoints = True


def _cfg(tmp_path, *extra):
    return load_config(None, [*_TINY, f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                              *extra])


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def live(tmp_path):
    """A controller holding the run, with the files a live run has in its folder."""
    trainer = PPOTrainer(_cfg(tmp_path, "telemetry.enabled=false"), roles_factory=_no_roles)
    trainer.claim()
    run = trainer.run_dir.path
    trainer.run_dir.append_metrics({"step": 1, "reward/mean": 0.5})
    trainer.run_dir.event("lease_acquired", holder="x", token=1, expires_at=0.0, previous=None)
    for name, text in (("controller.json", '{"state": "running"}\n'), ("train.log", "step 1\n"),
                       ("prometheus_targets.json", "[]\n")):
        (run / name).write_text(text)
    yield trainer
    trainer.shutdown()


@pytest.mark.parametrize("other", [
    [],                                                   # the same command again
    ["checkpoint.root={tmp}/other-ckpt"],                 # same run folder, another checkpoint root
    ["trainer.output_dir={tmp}/other-runs"],              # same checkpoint folder, another run folder
])
def test_a_refused_controller_leaves_the_live_run_byte_identical(live, tmp_path, other, monkeypatch):
    from resilient_rl.cli import _fit

    before = {p: _tree(p) for p in (live.run_dir.path, tmp_path / "ckpt" / "live")}
    cfg = _cfg(tmp_path, *[o.format(tmp=tmp_path) for o in other], "telemetry.enabled=true",
               "trainer.loggers=[console,jsonl,tensorboard]")
    assert not ray.is_initialized()
    real = PPOTrainer.__init__

    def with_no_roles(self, cfg, roles_factory=None, hooks=None):
        real(self, cfg, roles_factory=_no_roles, hooks=hooks)

    monkeypatch.setattr(PPOTrainer, "__init__", with_no_roles)
    with pytest.raises(LeaseHeldError, match=f"{os.getpid()}:"):
        _fit(cfg)
    assert not ray.is_initialized(), "the refused controller started Ray"
    assert {p: _tree(p) for p in before} == before
    assert not (tmp_path / "other-runs" / "live" / "config.yaml").exists()
    assert not (tmp_path / "other-ckpt" / "live" / "MANIFEST.json").exists()


def test_takeover_applies_to_one_start_only(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.takeover=true", "telemetry.enabled=false")
    trainer = PPOTrainer(cfg, roles_factory=_no_roles)
    trainer.claim()
    try:
        saved = yaml.safe_load((trainer.run_dir.path / "config.yaml").read_text())
        assert saved["checkpoint"]["takeover"] is False
        again = load_config(str(trainer.run_dir.path / "config.yaml"))
        assert again.checkpoint.takeover is False
        resumed = PPOTrainer(again, roles_factory=_no_roles)
        with pytest.raises(LeaseHeldError):  # a resume from the saved config does not displace it
            resumed.claim()
        resumed.shutdown()
    finally:
        trainer.shutdown()


def test_the_run_folder_lease_is_released_and_taken_again(tmp_path):
    first = PPOTrainer(_cfg(tmp_path, "telemetry.enabled=false"), roles_factory=_no_roles)
    first.claim()
    first.shutdown()
    second = PPOTrainer(_cfg(tmp_path, "telemetry.enabled=false"), roles_factory=_no_roles)
    second.claim()  # the first one released both leases
    second.shutdown()
