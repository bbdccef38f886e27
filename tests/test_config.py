"""Typed config: defaults, YAML + overrides, error messages, round-trip and digest."""

from __future__ import annotations

from pathlib import Path

import pytest

import resilient_rl
from resilient_rl.errors import ConfigError
from resilient_rl.config.schema import (
    Config,
    OptimConfig,
    config_digest,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)

CONFIGS = Path(resilient_rl.__file__).parent / "configs"


def test_defaults_match_documented_values():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.kind == "tiny" and cfg.model.hidden_size == 64 and cfg.model.max_seq_len == 64
    assert cfg.actor.optim.betas == [0.9, 0.999] and cfg.actor.world_size == 2
    assert cfg.critic.enabled is True
    assert cfg.algorithm.kl_ctrl.type == "fixed" and cfg.algorithm.kl_ctrl.horizon == 10000
    assert cfg.checkpoint.resume == "auto" and cfg.recovery.failure_window_s == 3600.0
    # Colocated roles run in the actor's processes, so their world sizes follow the actor's.
    assert cfg.rollout.world_size == 2 and cfg.ref.world_size == 2 and cfg.critic.world_size == 2


def test_split_placement_keeps_own_world_sizes():
    cfg = load_config(overrides=["trainer.placement=split", "rollout.world_size=1", "ref.world_size=1"])
    assert (cfg.rollout.world_size, cfg.ref.world_size, cfg.critic.world_size) == (1, 1, 1)


@pytest.mark.parametrize("override, fragments", [
    ("traner.seed=1", ["'traner'", "did you mean 'trainer'", "top level", "checkpoint"]),
    ("actor.optim.lrr=0.1", ["'actor.optim.lrr'", "did you mean 'actor.optim.lr'", "section 'actor.optim'",
                             "weight_decay"]),
    ("algorithm.kl_ctrl.kl_cof=0.1", ["'algorithm.kl_ctrl.kl_cof'", "'algorithm.kl_ctrl.kl_coef'", "horizon"]),
])
def test_unknown_keys_name_dotted_key_and_suggest(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("critic:\n  optim:\n    learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"'critic\.optim\.learning_rate'.*Allowed keys in section 'critic\.optim'"):
        load_config(str(path))


@pytest.mark.parametrize("override, key, expected", [
    ("trainer.total_steps=abc", "trainer.total_steps", "expected int"),
    ("data.shuffle=maybe", "data.shuffle", "expected bool"),
    ("actor.optim.betas=[0.9,x]", "actor.optim.betas", "expected list of float"),
    ("rollout.temperature=hot", "rollout.temperature", "expected float"),
])
def test_wrong_types_name_the_key(override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert key in str(info.value) and expected in str(info.value)


def test_section_given_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match=r"'actor' is a section.*clip_ratio"):
        load_config(overrides=["actor=3"])


def test_override_without_equals_sign_is_an_error():
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        load_config(overrides=["trainer.total_steps"])


@pytest.mark.parametrize("override, key", [
    ("actor.optim.lr=-1", "actor.optim.lr=-1.0"),
    ("critic.optim.lr=0", "critic.optim.lr=0.0"),
    ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type='pid'"),
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5"),
    ("telemetry.port=70000", "telemetry.port=70000"),
    ("checkpoint.resume=latest", "checkpoint.resume='latest'"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0"),
    ("trainer.run_name=a/b", "trainer.run_name='a/b'"),
    ("ray.cpus_per_worker=0", "ray.cpus_per_worker=0.0"),
    ("model.num_heads=3", "model.hidden_size=64"),
])
def test_range_errors_name_full_dotted_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert key in str(info.value)


def test_allowed_values_are_listed():
    with pytest.raises(ConfigError, match=r"trainer\.device='tpu'.*'auto', 'cpu', 'cuda'"):
        load_config(overrides=["trainer.device=tpu"])
    with pytest.raises(ConfigError, match=r"critic\.strategy='fsdp1'.*'auto', 'fsdp', 'ddp'"):
        load_config(overrides=["critic.strategy=fsdp1"])


def test_checkpoint_resume_accepts_path_prefix():
    cfg = load_config(overrides=["checkpoint.resume=path:s3://bucket/run/step_00000020"])
    assert cfg.checkpoint.resume == "path:s3://bucket/run/step_00000020"


def test_direct_construction_validates_and_widens_ints():
    with pytest.raises(ConfigError, match=r"OptimConfig\.lr=-1"):
        OptimConfig(lr=-1)
    with pytest.raises(ConfigError, match=r"OptimConfig\.warmup_steps='5'.*expected int"):
        OptimConfig(warmup_steps="5")  # type: ignore[arg-type]
    assert isinstance(OptimConfig(lr=1).lr, float)


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.adv_estimator=grpo"], r"rollout\.n=1.*grpo"),
    (["data.batch_size=3"], r"actor\.world_size=2.*data\.batch_size \* rollout\.n = 3"),
    (["trainer.placement=split", "critic.world_size=3"], r"critic\.world_size=3.*= 64 must be divisible"),
    (["actor.mini_batch_size=128"], r"actor\.mini_batch_size=128.*= 64"),
    (["data.task=jsonl"], r"data\.path"),
    (["data.task=jsonl", "data.path=x.jsonl"], r"data\.reward_fn"),
    (["data.task=add", "data.max_digits=6"], r"rollout\.max_new_tokens=4.*>= 7"),
])
def test_cross_field_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_a_gpu_run_s_config_reads_on_a_machine_without_one():
    """The controller may run on a Ray head without a GPU, and a warm spare sees none until it
    takes a rank's: whether the cluster has GPUs is checked against the cluster
    (``tests/test_node_layout.py``), not where the config is read."""
    assert load_config(overrides=["trainer.device=cuda"]).trainer.device == "cuda"


def test_grpo_turns_critic_off_and_ignores_critic_world_size():
    cfg = load_config(overrides=["algorithm.adv_estimator=grpo", "rollout.n=4", "critic.world_size=3"])
    assert cfg.critic.enabled is False


def test_unset_role_world_sizes_follow_the_actor_when_colocated():
    cfg = load_config(overrides=["actor.world_size=4"])
    assert (cfg.rollout.world_size, cfg.ref.world_size, cfg.critic.world_size) == (4, 4, 4)
    # Set to the actor's value is no conflict.
    same = load_config(overrides=["actor.world_size=4", "rollout.world_size=4", "ref.world_size=4",
                                  "critic.world_size=4"])
    assert same == cfg


@pytest.mark.parametrize("role", ["rollout", "ref", "critic"])
def test_a_colocated_role_world_size_other_than_the_actors_is_an_error(role):
    with pytest.raises(ConfigError, match=rf"{role}\.world_size=1: trainer\.placement='colocated'.*"
                                          r"must equal actor\.world_size=2"):
        load_config(overrides=[f"{role}.world_size=1"])


def test_split_role_world_sizes_default_to_one_and_keep_what_is_set():
    cfg = load_config(overrides=["trainer.placement=split", "rollout.world_size=2"])
    assert (cfg.rollout.world_size, cfg.ref.world_size, cfg.critic.world_size) == (2, 1, 1)


def test_critic_unset_follows_the_estimator_and_set_on_with_grpo_is_an_error():
    assert load_config().critic.enabled is True
    assert load_config(overrides=["critic.enabled=false"]).critic.enabled is False
    grpo = ["algorithm.adv_estimator=grpo", "rollout.n=4"]
    assert load_config(overrides=grpo).critic.enabled is False
    assert load_config(overrides=[*grpo, "critic.enabled=false"]).critic.enabled is False
    with pytest.raises(ConfigError, match=r"critic\.enabled=True: algorithm\.adv_estimator='grpo' trains no value"):
        load_config(overrides=[*grpo, "critic.enabled=true"])


def test_a_saved_config_with_resolved_world_sizes_loads_again(tmp_path):
    cfg = load_config(overrides=["actor.world_size=4"])
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    assert load_config(str(path)) == cfg
    # Changing the actor's world size on top of it names the roles that no longer match.
    with pytest.raises(ConfigError, match=r"rollout\.world_size=4.*actor\.world_size=2"):
        load_config(str(path), ["actor.world_size=2"])


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_steps: 7\n  seed: 3\nactor:\n  optim:\n    lr: 0.01\n")
    cfg = load_config(str(path), ["trainer.seed=9"])
    assert cfg.trainer.total_steps == 7  # from the file
    assert cfg.trainer.seed == 9  # override beats file
    assert cfg.actor.optim.lr == 0.01 and cfg.critic.optim.lr == 3e-3  # untouched keys keep defaults
    assert cfg.actor.optim.eps == 1e-8


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(bad))


def test_save_load_round_trip_and_digest(tmp_path):
    cfg = load_config(overrides=["trainer.total_steps=11", "model.kind=hf", "model.hf_config.n_layer=2",
                                 "checkpoint.root=memory://ckpt", "actor.optim.schedule=cosine"])
    path = tmp_path / "resolved.yaml"
    save_config(cfg, str(path))
    again = load_config(str(path))
    assert again == cfg
    assert config_digest(again) == config_digest(cfg)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    digest = config_digest(cfg)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert config_digest(load_config(overrides=["trainer.total_steps=12"])) != config_digest(
        load_config(overrides=["trainer.total_steps=11"]))


def test_digest_does_not_depend_on_how_the_config_was_built():
    # The digest goes into checkpoint manifests; it must not depend on dict order or process.
    a = config_digest(load_config(overrides=["trainer.seed=5"]))
    b = config_digest(config_from_dict({"trainer": {"seed": 5}}))
    assert a == b
    assert config_digest(Config()) == config_digest(load_config())


def test_save_config_to_fsspec_url():
    cfg = load_config(overrides=["trainer.run_name=urltest"])
    save_config(cfg, "memory://rrl-config-test/config.yaml")
    assert load_config("memory://rrl-config-test/config.yaml") == cfg


def test_example_configs_load():
    ppo = load_config(str(CONFIGS / "ppo_copy.yaml"))
    assert ppo == load_config()  # the example spells out the defaults
    grpo = load_config(str(CONFIGS / "grpo_add.yaml"))
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.critic.enabled is False
    assert grpo.rollout.n >= 2 and grpo.data.task == "add" and grpo.trainer.run_name == "grpo-add"
    assert (grpo.data.batch_size * grpo.rollout.n) % grpo.actor.world_size == 0


def test_interpolations_resolve_and_bad_ones_name_the_key(tmp_path):
    path = tmp_path / "interp.yaml"
    path.write_text("actor:\n  optim:\n    lr: 0.02\ncritic:\n  optim:\n    lr: ${actor.optim.lr}\n")
    assert load_config(str(path)).critic.optim.lr == 0.02
    with pytest.raises(ConfigError, match=r"critic\.optim\.lr.*nope\.x"):
        load_config(overrides=["critic.optim.lr=${nope.x}"])


def test_resume_off_on_the_command_line_is_off_not_a_boolean():
    # YAML reads the bare word `off` as a boolean; the key still means "start fresh".
    assert load_config(overrides=["checkpoint.resume=off"]).checkpoint.resume == "off"
    assert load_config(overrides=["checkpoint.resume=false"]).checkpoint.resume == "off"


def test_a_hugging_face_model_path_needs_kind_hf_and_brings_its_tokenizer():
    """model.path alone used to build the built-in tiny model (the folder ignored); a pretrained
    model read through the character tokenizer got ids meaningless to it."""
    from resilient_rl.config.schema import load_config
    from resilient_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.kind.*model.path is read only with model.kind=hf"):
        load_config(None, ["model.path=/models/qwen"])
    with pytest.raises(ConfigError, match=r"model.hf_config is read only with model.kind=hf"):
        load_config(None, ['model.hf_config={"model_type": "qwen2"}'])
    cfg = load_config(None, ["model.kind=hf", "model.path=/models/qwen"])
    assert cfg.data.tokenizer == "/models/qwen"
    mine = load_config(None, ["model.kind=hf", "model.path=/models/qwen", "data.tokenizer=/tok"])
    assert mine.data.tokenizer == "/tok"
