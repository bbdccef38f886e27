"""The table of verl's config keys: each with this project's key, or why it has none.

One :class:`VerlKey` per key of verl's ``ppo_trainer.yaml`` (the 2025 layout): its counterpart
here and how its value converts, or, with ``ours=None``, a note on why there is none. The
translation that applies the table to a config is :mod:`resilient_rl.config.verl_keys`; the
README's table for verl users is rendered from this one (and checked by a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from resilient_rl.errors import ConfigError

#: A converted value that means "leave the key at its default" (verl's null / -1 "unset").
DROP = object()


@dataclass(frozen=True)
class VerlKey:
    """One verl key: ``ours`` is the project's key (None: no counterpart, ``note`` says why).

    ``convert`` maps verl's value to ours; ``implies`` sets other keys unless the same config
    layer gives them; ``per_prompt``: verl counts prompts, ours sequences (times ``rollout.n``);
    ``subtree``: the entry covers every key under it; ``off``: values that ask for what this
    project does anyway, accepted without a counterpart."""

    verl: str
    ours: Optional[str]
    note: str = ""
    convert: Optional[Callable[[Any], Any]] = None
    implies: tuple[tuple[str, Any], ...] = ()
    per_prompt: bool = False
    subtree: bool = False
    off: tuple = ()


def _none_drops(value: Any) -> Any:
    return DROP if value is None else value


def _one_file(key: str, ours: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                raise ConfigError(f"{key}={list(value)!r}: one file is read ({ours}); "
                                  "concatenate the files into one")
            return value[0]
        return value
    return convert


def _freq(value: Any) -> Any:
    return 0 if isinstance(value, int) and value < 0 else value


def _warmup(value: Any) -> Any:
    return 0 if isinstance(value, int) and value < 0 else value


def _loggers(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _kl(value: Any) -> Any:
    return "k1" if value == "kl" else value


def _strategy(value: Any) -> Any:
    return "fsdp" if value == "fsdp2" else value


def _resume_mode(value: Any) -> Any:
    return {"disable": "off", "resume_path": DROP}.get(value, value)


def _resume_path(value: Any) -> Any:
    return DROP if value is None else f"path:{value}"


def _placement(value: Any) -> Any:
    return {True: "colocated", False: "split"}.get(value, value)


def _negate(value: Any) -> Any:
    return not value if isinstance(value, bool) else value


A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"
_MICRO = "micro-batches are sized in tokens here: actor.micro_batch_tokens (critic.micro_batch_tokens)"
_VAL = "validation generations are not written out; val/ metrics are"
_ENGINE = "the rollout engine is built in (rollout.engine), not vLLM or SGLang"
_OFFLOAD = "parameters and optimizer state stay on the device"

TABLE: tuple[VerlKey, ...] = (
    # data
    VerlKey("data.train_files", "data.path", "one file; .parquet is read as verl's data",
            _one_file("data.train_files", "data.path")),
    VerlKey("data.train_batch_size", "data.batch_size", "prompts per step"),
    VerlKey("data.max_response_length", "rollout.max_new_tokens"),
    VerlKey("data.max_prompt_length", "data.max_prompt_length", "a longer prompt is an error at start"),
    VerlKey("data.shuffle", "data.shuffle"),
    VerlKey("data.seed", "data.seed"),
    VerlKey("data.tokenizer", "data.tokenizer", "null: the character tokenizer (set it to the model folder)"),
    VerlKey("data.val_files", "data.val_path", "one file; .parquet is read as verl's data",
            _one_file("data.val_files", "data.val_path")),
    VerlKey("data.val_batch_size", "data.val_batch_size", "null: every validation prompt in one call"),
    VerlKey("data.prompt_key", None, "the prompt is the 'prompt' column", off=("prompt",)),
    VerlKey("data.reward_fn_key", None, "the reward gets data_source as its first argument",
            off=("data_source",)),
    VerlKey("data.truncation", None, "an overlong prompt is an error", off=("error",)),
    VerlKey("data.filter_overlong_prompts", None, "an overlong prompt is an error", off=(False,)),
    VerlKey("data.filter_overlong_prompts_workers", None, "", off=(1,)),
    VerlKey("data.return_raw_input_ids", None, "", off=(False,)),
    VerlKey("data.return_raw_chat", None, "", off=(False,)),
    VerlKey("data.image_key", None, "text only", off=("images",)),
    VerlKey("data.video_key", None, "text only", off=("videos",)),
    VerlKey("data.custom_cls", None, "datasets are JSONL or verl's parquet", subtree=True, off=(None,)),
    # the model
    VerlKey("actor_rollout_ref.model.path", "model.path", "a Hugging Face folder; also sets model.kind=hf and "
            "data.tokenizer to the folder unless given", implies=(("model.kind", "hf"),)),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", "actor.activation_checkpointing"),
    VerlKey("actor_rollout_ref.model.use_remove_padding", "actor.packing"),
    VerlKey("actor_rollout_ref.model.external_lib", None, "", off=(None,)),
    VerlKey("actor_rollout_ref.model.override_config", None, "model.hf_config builds a model from a config",
            subtree=True, off=({},)),
    VerlKey("actor_rollout_ref.model.use_liger", None, "", off=(False,)),
    VerlKey("actor_rollout_ref.model.use_fused_kernels", None, "", off=(False,)),
    VerlKey("actor_rollout_ref.model.trust_remote_code", None, "architectures come with transformers",
            off=(False,)),
    VerlKey("actor_rollout_ref.model.use_shm", None, "", off=(False,)),
    VerlKey("actor_rollout_ref.model.lora_rank", None, "full fine-tuning only", off=(0,)),
    VerlKey("actor_rollout_ref.hybrid_engine", "trainer.placement", "true: colocated, false: split", _placement),
    # the actor
    VerlKey(f"{A}.strategy", "actor.strategy", "fsdp and fsdp2 are FSDP2", _strategy),
    VerlKey(f"{A}.ppo_mini_batch_size", "actor.mini_batch_size", "verl counts prompts; times rollout.n",
            per_prompt=True),
    VerlKey(f"{A}.ppo_micro_batch_size", None, _MICRO, off=(None,)),
    VerlKey(f"{A}.ppo_micro_batch_size_per_gpu", None, _MICRO, off=(None,)),
    VerlKey(f"{A}.use_dynamic_bsz", None, _MICRO + " (always dynamic)", off=(True,)),
    VerlKey(f"{A}.ppo_max_token_len_per_gpu", "actor.micro_batch_tokens", "bounds every micro-batch"),
    VerlKey(f"{A}.grad_clip", "actor.optim.grad_clip"),
    VerlKey(f"{A}.clip_ratio", "actor.clip_ratio"),
    VerlKey(f"{A}.clip_ratio_low", None, "one clip_ratio both ways"),
    VerlKey(f"{A}.clip_ratio_high", None, "one clip_ratio both ways"),
    VerlKey(f"{A}.clip_ratio_c", "actor.clip_ratio_c", "dual-clip PPO"),
    VerlKey(f"{A}.loss_agg_mode", "actor.loss_agg_mode"),
    VerlKey(f"{A}.entropy_coeff", "actor.entropy_coeff"),
    VerlKey(f"{A}.use_kl_loss", "actor.use_kl_loss"),
    VerlKey(f"{A}.kl_loss_coef", "actor.kl_loss_coef"),
    VerlKey(f"{A}.kl_loss_type", "actor.kl_loss_type", "kl is k1", _kl),
    VerlKey(f"{A}.use_torch_compile", "actor.compile"),
    VerlKey(f"{A}.ppo_epochs", "actor.ppo_epochs"),
    VerlKey(f"{A}.shuffle", "actor.shuffle", "the default is true here"),
    VerlKey(f"{A}.ulysses_sequence_parallel_size", None, "no sequence parallelism", off=(1,)),
    VerlKey(f"{A}.checkpoint", None, "checkpoints hold model, optimizer and the rest; export writes a HF folder",
            subtree=True),
    VerlKey(f"{A}.optim.lr", "actor.optim.lr"),
    VerlKey(f"{A}.optim.lr_warmup_steps", "actor.optim.warmup_steps", "-1 is 0", _warmup),
    VerlKey(f"{A}.optim.lr_warmup_steps_ratio", None, "give warmup steps", off=(0, 0.0)),
    VerlKey(f"{A}.optim.min_lr_ratio", "actor.optim.min_lr_ratio", "", _none_drops),
    VerlKey(f"{A}.optim.warmup_style", "actor.optim.schedule"),
    VerlKey(f"{A}.optim.weight_decay", "actor.optim.weight_decay"),
    VerlKey(f"{A}.optim.betas", "actor.optim.betas"),
    VerlKey(f"{A}.optim.total_training_steps", None, "trainer.total_steps", off=(-1,)),
    VerlKey(f"{A}.fsdp_config.reshard_after_forward", "actor.reshard_after_forward"),
    VerlKey(f"{A}.fsdp_config.param_offload", None, _OFFLOAD, off=(False,)),
    VerlKey(f"{A}.fsdp_config.optimizer_offload", None, _OFFLOAD, off=(False,)),
    VerlKey(f"{A}.fsdp_config.offload_policy", None, _OFFLOAD, off=(False,)),
    VerlKey(f"{A}.fsdp_config.fsdp_size", None, "trainer.sharding=hybrid shards within a node", off=(-1,)),
    VerlKey(f"{A}.fsdp_config.wrap_policy", None, "each transformer block is a unit", subtree=True),
    # the reference policy
    VerlKey("actor_rollout_ref.ref.fsdp_config.reshard_after_forward", "ref.reshard_after_forward"),
    VerlKey("actor_rollout_ref.ref.fsdp_config.param_offload", None, _OFFLOAD, off=(False,)),
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size", None, _MICRO, off=(None,)),
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", None, _MICRO, off=(None,)),
    VerlKey("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", None, _MICRO + " (always dynamic)", off=(True,)),
    VerlKey("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", None, _MICRO),
    VerlKey("actor_rollout_ref.ref.strategy", None, "the reference is sharded as the actor", off=("fsdp", "fsdp2")),
    VerlKey("actor_rollout_ref.ref.use_torch_compile", None, "actor.compile", off=(False,)),
    VerlKey("actor_rollout_ref.ref.ulysses_sequence_parallel_size", None, "no sequence parallelism", off=(1,)),
    VerlKey("actor_rollout_ref.ref.fsdp_config.wrap_policy", None, "each transformer block is a unit",
            subtree=True),
    # the rollout
    VerlKey(f"{R}.n", "rollout.n", "samples per prompt"),
    VerlKey(f"{R}.temperature", "rollout.temperature"),
    VerlKey(f"{R}.top_p", "rollout.top_p"),
    VerlKey(f"{R}.response_length", "rollout.max_new_tokens"),
    VerlKey(f"{R}.dtype", "model.dtype", "one dtype for the trained passes and generation"),
    VerlKey(f"{R}.enforce_eager", "rollout.cuda_graphs", "negated", _negate),
    VerlKey(f"{R}.top_k", None, "top_p sampling only", off=(-1, 0)),
    VerlKey(f"{R}.name", None, _ENGINE),
    VerlKey(f"{R}.mode", None, _ENGINE, off=("sync",)),
    VerlKey(f"{R}.gpu_memory_utilization", None, _ENGINE + "; its KV cache is sized from the batch"),
    VerlKey(f"{R}.tensor_model_parallel_size", None, "no tensor parallelism", off=(1,)),
    VerlKey(f"{R}.do_sample", None, "rollouts sample (temperature > 0)", off=(True,)),
    VerlKey(f"{R}.ignore_eos", None, "", off=(False,)),
    VerlKey(f"{R}.free_cache_engine", None, _ENGINE),
    VerlKey(f"{R}.load_format", None, _ENGINE),
    VerlKey(f"{R}.max_num_batched_tokens", None, _ENGINE),
    VerlKey(f"{R}.max_model_len", None, "model.max_seq_len"),
    VerlKey(f"{R}.max_num_seqs", None, _ENGINE),
    VerlKey(f"{R}.enable_chunked_prefill", None, _ENGINE),
    VerlKey(f"{R}.disable_log_stats", None, _ENGINE),
    VerlKey(f"{R}.log_prob_micro_batch_size", None, _MICRO, off=(None,)),
    VerlKey(f"{R}.log_prob_micro_batch_size_per_gpu", None, _MICRO, off=(None,)),
    VerlKey(f"{R}.log_prob_use_dynamic_bsz", None, _MICRO + " (always dynamic)", off=(True,)),
    VerlKey(f"{R}.log_prob_max_token_len_per_gpu", None, _MICRO),
    VerlKey(f"{R}.prompt_length", None, "data.max_prompt_length"),
    VerlKey(f"{R}.use_fire_sampling", None, "", off=(False,)),
    VerlKey(f"{R}.chat_scheduler", None, "", off=(None,)),
    VerlKey(f"{R}.engine_kwargs", None, _ENGINE, subtree=True),
    VerlKey(f"{R}.val_kwargs.do_sample", "rollout.val_kwargs.do_sample", "false: greedy"),
    VerlKey(f"{R}.val_kwargs.temperature", "rollout.val_kwargs.temperature"),
    VerlKey(f"{R}.val_kwargs.top_p", "rollout.val_kwargs.top_p"),
    VerlKey(f"{R}.val_kwargs.n", "rollout.val_kwargs.n", "responses per validation prompt"),
    VerlKey(f"{R}.val_kwargs.top_k", None, "top_p sampling only", off=(-1, 0)),
    VerlKey(f"{R}.multi_turn", None, "single-turn rollouts", subtree=True),
    # the critic (verl's critic.optim.*, ppo_epochs and cliprange_value are this project's keys too)
    VerlKey(f"{C}.ppo_mini_batch_size", "critic.mini_batch_size", "verl counts prompts; times rollout.n",
            per_prompt=True),
    VerlKey(f"{C}.ppo_micro_batch_size_per_gpu", None, _MICRO, off=(None,)),
    VerlKey(f"{C}.ppo_max_token_len_per_gpu", "critic.micro_batch_tokens"),
    VerlKey(f"{C}.grad_clip", "critic.optim.grad_clip"),
    VerlKey(f"{C}.strategy", "critic.strategy", "fsdp and fsdp2 are FSDP2", _strategy),
    VerlKey(f"{C}.optim.lr_warmup_steps", "critic.optim.warmup_steps", "-1 is 0", _warmup),
    VerlKey(f"{C}.optim.warmup_style", "critic.optim.schedule"),
    VerlKey(f"{C}.optim.min_lr_ratio", "critic.optim.min_lr_ratio", "", _none_drops),
    VerlKey(f"{C}.optim.lr_warmup_steps_ratio", None, "give warmup steps", off=(0, 0.0)),
    VerlKey(f"{C}.enable", "critic.enabled", "null: on for gae, off for grpo"),
    VerlKey(f"{C}.model.enable_gradient_checkpointing", "critic.activation_checkpointing"),
    VerlKey(f"{C}.model", None, "the critic is built from model.* with a value head", subtree=True),
    VerlKey(f"{C}.fsdp_config.reshard_after_forward", "critic.reshard_after_forward"),
    VerlKey(f"{C}.fsdp_config.param_offload", None, _OFFLOAD, off=(False,)),
    VerlKey(f"{C}.fsdp_config.optimizer_offload", None, _OFFLOAD, off=(False,)),
    VerlKey(f"{C}.fsdp_config.offload_policy", None, _OFFLOAD, off=(False,)),
    VerlKey(f"{C}.fsdp_config.fsdp_size", None, "trainer.sharding=hybrid shards within a node", off=(-1,)),
    VerlKey(f"{C}.fsdp_config.wrap_policy", None, "each transformer block is a unit", subtree=True),
    VerlKey(f"{C}.ppo_micro_batch_size", None, _MICRO, off=(None,)),
    VerlKey(f"{C}.forward_micro_batch_size", None, _MICRO, off=(None,)),
    VerlKey(f"{C}.forward_micro_batch_size_per_gpu", None, _MICRO, off=(None,)),
    VerlKey(f"{C}.use_dynamic_bsz", None, _MICRO + " (always dynamic)", off=(True,)),
    VerlKey(f"{C}.forward_max_token_len_per_gpu", None, _MICRO),
    VerlKey(f"{C}.ulysses_sequence_parallel_size", None, "no sequence parallelism", off=(1,)),
    VerlKey(f"{C}.shuffle", "critic.shuffle", "the default is true here"),
    VerlKey(f"{C}.checkpoint", None, "checkpoints hold model, optimizer and the rest", subtree=True),
    VerlKey(f"{C}.optim.total_training_steps", None, "trainer.total_steps", off=(-1,)),
    VerlKey(f"{C}.rollout_n", None, "rollout.n"),
    # rewards
    VerlKey("reward_model.enable", None, "rewards are functions (custom_reward_function.path, data.reward_fn)",
            off=(False,)),
    VerlKey("reward_model", None, "rewards are functions (custom_reward_function.path, data.reward_fn)",
            subtree=True),
    VerlKey("custom_reward_function.reward_kwargs", None, "the function gets verl's four arguments only",
            subtree=True, off=({},)),
    # the algorithm (verl's algorithm.* keys are this project's keys too)
    VerlKey("algorithm.kl_penalty", "algorithm.kl_penalty", "kl is k1", _kl),
    # the trainer
    VerlKey("trainer.total_epochs", "trainer.total_epochs", "steps = epochs x (prompts // data.batch_size)"),
    VerlKey("trainer.total_training_steps", "trainer.total_steps", "", _none_drops),
    VerlKey("trainer.experiment_name", "trainer.run_name"),
    VerlKey("trainer.logger", "trainer.loggers", "a name or a list", _loggers),
    VerlKey("trainer.save_freq", "checkpoint.save_every", "-1 is 0 (off)", _freq),
    VerlKey("trainer.default_local_dir", "checkpoint.root", "checkpoints go under <dir>/<trainer.run_name>/"),
    VerlKey("trainer.resume_mode", "checkpoint.resume", "disable is off; resume_path takes resume_from_path",
            _resume_mode),
    VerlKey("trainer.resume_from_path", "checkpoint.resume", "path:<step folder>", _resume_path),
    VerlKey("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last", "", _none_drops),
    VerlKey("trainer.max_critic_ckpt_to_keep", "checkpoint.keep_last", "", _none_drops),
    VerlKey("trainer.test_freq", "trainer.test_freq", "-1 is 0 (off); the last step is validated too", _freq),
    VerlKey("trainer.val_before_train", "trainer.val_before_train", "a step 0 row of val/ metrics"),
    VerlKey("trainer.log_val_generations", None, _VAL, off=(0,)),
    VerlKey("trainer.val_only", None, "a run trains; validation runs between its steps", off=(False,)),
    VerlKey("trainer.balance_batch", None, "", off=(False,)),
    VerlKey("trainer.critic_warmup", None, "", off=(0,)),
    VerlKey("trainer.rollout_data_dir", None, "", off=(None,)),
    VerlKey("trainer.validation_data_dir", None, _VAL, off=(None,)),
    VerlKey("trainer.default_hdfs_dir", None, "checkpoint.root takes any fsspec URL", off=(None,)),
    VerlKey("trainer.del_local_ckpt_after_load", None, "", off=(False,)),
    VerlKey("trainer.ray_wait_register_center_timeout", None, "recovery.placement_timeout_s"),
    VerlKey("ray_init.num_cpus", "ray.num_cpus", "", _none_drops),
)
# Keys verl and this project spell alike (algorithm.gamma, critic.optim.lr, trainer.nnodes, ...)
# need no entry: they are this project's keys.
