"""A node-local checkpoint root is refused on a multi-node cluster unless declared shared."""

from __future__ import annotations

import pytest

from resilient_rl.checkpoint.shared_root import is_local_root, require_shared_root
from resilient_rl.config.schema import load_config
from resilient_rl.errors import ConfigError
from resilient_rl.runtime import cluster
from resilient_rl.trainer.ppo import PPOTrainer


def _cfg(tmp_path, *extra):
    return load_config(None, ["trainer.progress_bar=false", "data.num_prompts=64", "telemetry.enabled=false",
                              f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt", *extra])


@pytest.mark.parametrize("root,local", [("checkpoints", True), ("/mnt/ckpt", True), ("file:///mnt/ckpt", True),
                                        ("s3://bucket/runs", False), ("gs://bucket/runs", False),
                                        ("memory://ckpt", False)])
def test_local_roots_are_told_from_remote_ones(root, local):
    assert is_local_root(root) is local


def test_a_local_root_is_refused_on_several_nodes_and_the_error_names_the_keys(tmp_path):
    c = _cfg(tmp_path).checkpoint
    require_shared_root(c, nodes=1)  # one node: every rank writes to the same disk
    with pytest.raises(ConfigError, match=r"checkpoint\.shared_filesystem=true") as err:
        require_shared_root(c, nodes=2)
    assert "checkpoint.root=" in str(err.value) and "2 nodes" in str(err.value)


def test_a_shared_or_remote_root_is_accepted_on_several_nodes(tmp_path):
    require_shared_root(_cfg(tmp_path, "checkpoint.shared_filesystem=true").checkpoint, nodes=4)
    require_shared_root(_cfg(tmp_path, "checkpoint.root=s3://bucket/runs").checkpoint, nodes=4)


def test_shared_filesystem_must_be_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match="shared_filesystem"):
        _cfg(tmp_path, "checkpoint.shared_filesystem=maybe")


class _NoWorkersExpected:
    """A roles factory that fails the test if the trainer gets as far as starting workers."""

    writes_checkpoints = True

    def __init__(self, cfg, tokenizer):
        raise AssertionError("workers were started although the checkpoint root cannot be shared")


def test_the_trainer_refuses_at_start_before_the_lease_and_any_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "alive_nodes", lambda: 3)  # as on a 3-node cluster
    trainer = PPOTrainer(_cfg(tmp_path), roles_factory=_NoWorkersExpected)
    try:
        with pytest.raises(ConfigError, match="shared_filesystem"):
            trainer.start_roles()
        assert trainer.ckpt.lease is None  # refused before taking the run's lease
    finally:
        trainer.shutdown()
