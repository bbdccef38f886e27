"""verl's config keys: aliases of this project's keys from one table, in overrides and YAML files
alike; verl keys without a counterpart are named; the README's table is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from resilient_rl.config.schema import config_to_dict, load_config, save_config
from resilient_rl.config.verl_keys import TABLE, markdown_table
from resilient_rl.errors import ConfigError
from resilient_rl.trainer.ppo import resolve_total_epochs

VERL_LINE = ["data.train_files=[/data/gsm8k/train.parquet]", "data.train_batch_size=16",
             "data.max_response_length=12", "actor_rollout_ref.actor.optim.lr=1e-6",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.actor.kl_loss_type=kl", "algorithm.adv_estimator=grpo",
             "algorithm.kl_ctrl.kl_coef=0.01", "trainer.total_epochs=3", "trainer.save_freq=-1",
             "trainer.logger=['console','jsonl']", "trainer.default_local_dir=/ckpt",
             "trainer.experiment_name=gsm8k-grpo", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
             "custom_reward_function.path=/r/score.py", "custom_reward_function.name=score",
             "+trainer.val_before_train=False", "reward_model.enable=False", "actor.world_size=2"]


def _check_verl_line(cfg) -> None:
    assert cfg.data.path == "/data/gsm8k/train.parquet" and cfg.data.task == "parquet"
    assert cfg.data.batch_size == 16 and cfg.rollout.max_new_tokens == 12
    assert cfg.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.actor.mini_batch_size == 32  # verl counts prompts: 8 prompts x rollout.n=4 sequences
    assert cfg.rollout.n == 4 and cfg.rollout.temperature == pytest.approx(0.7)
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "k1"
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.kl_ctrl.kl_coef == pytest.approx(0.01)
    assert cfg.trainer.total_epochs == 3 and cfg.checkpoint.save_every == 0
    assert cfg.trainer.loggers == ["console", "jsonl"] and cfg.checkpoint.root == "/ckpt"
    assert cfg.trainer.run_name == "gsm8k-grpo" and cfg.trainer.n_gpus_per_node == 2
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == ("/r/score.py", "score")


def test_a_verl_command_line_sets_this_projects_keys():
    _check_verl_line(load_config(None, VERL_LINE))


def test_a_verl_yaml_file_reads_as_the_same_command_line(tmp_path):
    verl_yaml = {
        "data": {"train_files": "/data/gsm8k/train.parquet", "train_batch_size": 16, "max_response_length": 12},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 8, "use_kl_loss": True,
                                        "kl_loss_type": "kl"},
                              "rollout": {"n": 4, "temperature": 0.7, "top_k": -1}},
        "algorithm": {"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.01}},
        "trainer": {"total_epochs": 3, "save_freq": -1, "logger": ["console", "jsonl"],
                    "default_local_dir": "/ckpt", "experiment_name": "gsm8k-grpo", "nnodes": 1,
                    "n_gpus_per_node": 2, "val_before_train": False},
        "custom_reward_function": {"path": "/r/score.py", "name": "score"},
        "reward_model": {"enable": False},
        "actor": {"world_size": 2},
    }
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(verl_yaml))
    cfg = load_config(str(path))
    _check_verl_line(cfg)
    # The saved config names this project's keys only, and reads back to the same config.
    save_config(cfg, str(tmp_path / "saved.yaml"))
    saved = yaml.safe_load((tmp_path / "saved.yaml").read_text())
    assert "actor_rollout_ref" not in saved and "logger" not in saved["trainer"]
    assert config_to_dict(load_config(str(tmp_path / "saved.yaml"))) == config_to_dict(cfg)


def test_verl_keys_without_a_counterpart_are_named_all_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor_rollout_ref.rollout.name=vllm", "trainer.val_only=true",
                           "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "reward_model.model.path=/rm",
                           "actor_rollout_ref.actor.optim.lr=1e-6"])
    msg = str(err.value)
    assert "verl keys with no counterpart in resilient-rl" in msg
    for key in ("actor_rollout_ref.rollout.name", "trainer.val_only",
                "actor_rollout_ref.rollout.gpu_memory_utilization", "reward_model.model.path"):
        assert f"'{key}'" in msg
    assert "optim.lr" not in msg
    # A value that asks for what this project does anyway is accepted.
    load_config(None, ["actor_rollout_ref.rollout.top_k=-1", "trainer.test_freq=-1", "reward_model.enable=false",
                       "actor_rollout_ref.actor.fsdp_config.param_offload=False", "data.custom_cls.path=null"])
    # A key with an alias inside a section that has none: the alias is taken, the rest named.
    cfg = load_config(None, ["critic.model.enable_gradient_checkpointing=True", "critic.enable=True"])
    assert cfg.critic.activation_checkpointing and cfg.critic.enabled
    with pytest.raises(ConfigError, match=r"'critic.model.path' \(the critic is built from model"):
        load_config(None, ["critic.model.enable_gradient_checkpointing=True", "critic.model.path=/m"])
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.fsdp_config.param_offload' \(parameters"):
        load_config(None, ["actor_rollout_ref.actor.fsdp_config.param_offload=True"])


def test_misspelt_keys_get_a_did_you_mean_among_verl_and_project_names():
    with pytest.raises(ConfigError, match=r"unknown verl config keys: 'actor_rollout_ref.actor.optim.lrr' "
                                          r"\(did you mean 'actor_rollout_ref.actor.optim.lr'\?\)"):
        load_config(None, ["actor_rollout_ref.actor.optim.lrr=1e-6"])
    with pytest.raises(ConfigError, match=r"unknown config key 'data.train_file' \(did you mean 'data.train_files'"):
        load_config(None, ["data.train_file=x.parquet"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_step' \(did you mean "
                                          r"'trainer.total_steps'"):
        load_config(None, ["trainer.total_step=3"])


def test_a_bad_value_names_the_verl_key_it_was_given_as():
    with pytest.raises(ConfigError, match=r"actor.optim.lr=-1.0: must be > 0 \('actor.optim.lr' was given as "
                                          r"verl's 'actor_rollout_ref.actor.optim.lr'\)"):
        load_config(None, ["actor_rollout_ref.actor.optim.lr=-1"])


def test_two_keys_for_one_setting_must_agree():
    with pytest.raises(ConfigError, match=r"'data.batch_size' and 'data.train_batch_size' both set 'data.batch_size'"):
        load_config(None, ["data.batch_size=4", "data.train_batch_size=8"])
    assert load_config(None, ["data.batch_size=32", "data.train_batch_size=32"]).data.batch_size == 32


def test_model_path_implies_an_hf_model_and_its_tokenizer_unless_given(tmp_path):
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/qwen"])
    assert (cfg.model.kind, cfg.model.path, cfg.data.tokenizer) == ("hf", "/models/qwen", "/models/qwen")
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/qwen", "data.tokenizer=/tok"])
    assert cfg.data.tokenizer == "/tok"
    # A file's model.kind is overridden by a later layer's verl model path (the path implies hf).
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  kind: tiny\nactor:\n  mini_batch_size: 8\n")
    cfg = load_config(str(path), ["actor_rollout_ref.model.path=/m"])
    assert cfg.model.kind == "hf"


def test_prompt_counted_mini_batches_follow_the_last_layer_that_set_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 2\n  rollout:\n    n: 2\n")
    assert load_config(str(path)).actor.mini_batch_size == 4
    assert load_config(str(path), ["actor_rollout_ref.rollout.n=4"]).actor.mini_batch_size == 8
    assert load_config(str(path), ["actor.mini_batch_size=2"]).actor.mini_batch_size == 2
    assert load_config(None, ["critic.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
                              "data.batch_size=8", "actor.mini_batch_size=8"]).critic.mini_batch_size == 8


def test_the_models_context_is_verls_prompt_plus_response_length_unless_given(tmp_path):
    lengths = ["data.max_prompt_length=96", "data.max_response_length=8"]
    assert load_config(None, lengths).model.max_seq_len == 104
    assert load_config(None, lengths + ["model.max_seq_len=300"]).model.max_seq_len == 300
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  max_seq_len: 200\n")
    assert load_config(str(path), lengths).model.max_seq_len == 200
    assert load_config(None, []).model.max_seq_len == 64


def test_total_epochs_sets_total_steps_from_the_number_of_prompts():
    small = ["data.batch_size=4", "actor.mini_batch_size=4", "algorithm.adv_estimator=grpo", "rollout.n=2"]
    cfg = load_config(None, ["trainer.total_epochs=3"] + small)
    resolve_total_epochs(cfg, 10)
    assert cfg.trainer.total_steps == 3 * (10 // 4)  # an epoch's last incomplete batch is dropped
    cfg = load_config(None, ["trainer.total_steps=7"] + small)
    resolve_total_epochs(cfg, 10)
    assert cfg.trainer.total_steps == 7


def test_every_table_entry_is_a_real_key_and_the_readme_shows_the_table():
    from resilient_rl.config.resume import flatten
    from resilient_rl.config.schema import Config

    ours = set(flatten(config_to_dict(Config())))
    for entry in TABLE:
        assert entry.ours is None or entry.ours in ours, entry
        assert entry.ours is not None or entry.note or entry.off, entry  # a missing key says why
        # A key the project has gained is an alias now, not a key without a counterpart.
        assert entry.ours is not None or not any(k == entry.verl or k.startswith(entry.verl + ".") for k in ours), \
            f"{entry.verl} is a key of this project now: map it in config/verl_table.py"
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- verl-keys:begin[^\n]*-->\n(.*?)\n<!-- verl-keys:end -->", readme, re.S)
    assert found is not None, "README.md lacks the verl key table"
    assert found.group(1) == markdown_table(), "README.md's verl key table is stale: paste markdown_table()"


def test_the_cli_refuses_a_verl_key_without_a_counterpart_with_exit_2(capsys):
    from resilient_rl import cli

    assert cli.main(["-q", "train", "actor_rollout_ref.rollout.name=vllm", "data.train_batch_size=8"]) == 2
    err = capsys.readouterr().err
    assert "'actor_rollout_ref.rollout.name'" in err and "no counterpart" in err
