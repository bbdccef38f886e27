"""Typed configuration: the root :class:`Config`, YAML files and ``key=value`` overrides.

The sections (one dataclass per component) live in :mod:`resilient_rl.config.sections`
and :mod:`resilient_rl.config.runtime` and are re-exported here; :class:`Config` adds the
checks that span sections. :func:`load_config` layers the defaults, a YAML file and command-line
overrides with OmegaConf structured configs, so unknown keys and wrong types are caught before any
value is used. Every error is a
:class:`~resilient_rl.errors.ConfigError` naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import fsspec
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from resilient_rl.errors import ConfigError
from resilient_rl.config.node_layout import config_layouts
from resilient_rl.config.paths import resolve_path
from resilient_rl.config.secrets import REDACTED, redact, remember_secrets
from resilient_rl.config import verl_keys
from resilient_rl.config.runtime import (
    CheckpointConfig,
    RayConfig,
    RecoveryConfig,
    TelemetryConfig,
    TrainerConfig,
)
from resilient_rl.config.data_sections import CustomRewardConfig, DataConfig
from resilient_rl.config.sections import (
    BUILTIN_TASKS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    FILE_TASKS,
    KLControlConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RolloutConfig,
)
from resilient_rl.config.section import ConfigFieldError, require, Section, type_name

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_TASKS", "KL_ESTIMATORS", "LOSS_AGG_MODES", "ActorConfig", "AlgorithmConfig", "CheckpointConfig",
    "Config", "ConfigFieldError", "CriticConfig", "CustomRewardConfig", "DataConfig", "KLControlConfig", "ModelConfig", "OptimConfig",
    "RayConfig", "RecoveryConfig", "RefConfig", "RolloutConfig", "TelemetryConfig", "TrainerConfig",
    "REDACTED", "config_digest", "config_from_dict", "config_to_dict", "load_config", "redact_secrets",
    "redacted_config_dict", "save_config",
]


@dataclass
class Config(Section):
    """The whole run. Cross-section rules are checked here; keys in errors are full dotted paths."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    #: verl's name for a reward function in a file (see resilient_rl.config.data_sections).
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)

    _root = True

    def validate(self) -> None:
        if self.checkpoint.storage_options:
            self.checkpoint.storage_options = _drop_redacted(self.checkpoint.storage_options,
                                                             "checkpoint.storage_options")
        self.data.task = self.data.resolved_task  # the saved config names the task a null meant
        if self.model.kind == "hf" and self.model.path is not None and self.data.tokenizer is None:
            # A pretrained model reads only its own tokenizer's ids (verl reads it from the folder too);
            # the character tokenizer's would be meaningless to it.
            self.data.tokenizer = self.model.path
        grpo = self.algorithm.adv_estimator == "grpo"
        self._resolve_critic(grpo)
        self._resolve_world_sizes()
        config_layouts(self)  # a role whose ranks do not divide over its nodes is refused here
        require(not grpo or self.rollout.n >= 2, "rollout.n", self.rollout.n,
                 "algorithm.adv_estimator='grpo' needs rollout.n >= 2 samples per prompt")
        sequences = self.data.batch_size * self.rollout.n
        roles = [("actor", self.actor)] + ([("critic", self.critic)] if self.critic.enabled else [])
        for role, section in roles:
            require(sequences % section.world_size == 0, f"{role}.world_size", section.world_size,
                     f"data.batch_size * rollout.n = {sequences} must be divisible by it")
            require(section.mini_batch_size <= sequences, f"{role}.mini_batch_size", section.mini_batch_size,
                     f"must be <= data.batch_size * rollout.n = {sequences}")
            # Each rank updates on mini_batch_size // world_size rows of its share of the step's
            # sequences: exact only when both divisions are.
            require(section.mini_batch_size % section.world_size == 0, f"{role}.mini_batch_size",
                     section.mini_batch_size, f"must be divisible by {role}.world_size={section.world_size}")
            require(sequences % section.mini_batch_size == 0, f"{role}.mini_batch_size", section.mini_batch_size,
                     f"must divide data.batch_size * rollout.n = {sequences}")
        self._check_reward()
        held_out = self.data.val_path is not None or self.data.val_num_prompts > 0
        for key, wants in (("trainer.test_freq", self.trainer.test_freq), ("trainer.val_before_train",
                                                                           self.trainer.val_before_train)):
            require(not wants or held_out, key, wants, "validation needs held-out prompts: data.val_path "
                    "(a JSONL or parquet file) or, for a built-in task, data.val_num_prompts")
        if self.data.task in BUILTIN_TASKS:
            # The longest answer (a sum carries one extra digit) must fit in the response.
            longest = self.data.max_digits + (1 if self.data.task == "add" else 0)
            require(self.rollout.max_new_tokens >= longest, "rollout.max_new_tokens", self.rollout.max_new_tokens,
                     f"must be >= {longest}, the longest answer of data.task={self.data.task!r}")

    def _check_reward(self) -> None:
        """A file of prompts is scored by exactly one of data.reward_fn and
        custom_reward_function.path (two would leave it unclear which one the run used)."""
        custom = self.custom_reward_function.path
        if self.data.task in FILE_TASKS:
            require(self.data.reward_fn is not None or custom is not None, "data.reward_fn", self.data.reward_fn,
                    f"data.task={self.data.task!r} needs a reward: data.reward_fn ('package.module:function' or "
                    "a built-in name) or custom_reward_function.path (a file holding verl's compute_score)")
            require(self.data.reward_fn is None or custom is None, "custom_reward_function.path", custom,
                    f"data.reward_fn={self.data.reward_fn!r} is set too; give one reward, not both")
        else:
            require(custom is None, "custom_reward_function.path", custom,
                    f"scores prompts read from a file (data.path); data.task={self.data.task!r} is a built-in task "
                    "with its own reward (to replace it, give data.reward_fn: 'package.module:function' called as "
                    "(response, answer))")

    def _resolve_critic(self, grpo: bool) -> None:
        """``critic.enabled`` unset: on for GAE, off for GRPO (whose baseline is the group mean).
        Set to true with GRPO is an error rather than silently turned off."""
        if self.critic.enabled is None:
            self.critic.enabled = not grpo
        require(not (grpo and self.critic.enabled), "critic.enabled", self.critic.enabled,
                "algorithm.adv_estimator='grpo' trains no value model (its baseline is the group mean); "
                "leave critic.enabled unset or set it to false")

    def _resolve_world_sizes(self) -> None:
        """Unset (None) role world sizes become the actor's when colocated (the roles run in the
        actor's processes) and 1 when split. A value set to anything else than the actor's under
        colocated placement is an error naming the key; a disabled critic's is not checked."""
        colocated = self.trainer.placement == "colocated"
        for role, section in (("rollout", self.rollout), ("ref", self.ref), ("critic", self.critic)):
            if section.world_size is None:
                section.world_size = self.actor.world_size if colocated else 1
            elif colocated and (role != "critic" or self.critic.enabled):
                require(section.world_size == self.actor.world_size, f"{role}.world_size", section.world_size,
                        f"trainer.placement='colocated' runs every role in the actor's processes, so it must "
                        f"equal actor.world_size={self.actor.world_size}; leave it unset (null) to follow "
                        f"the actor, or use trainer.placement=split")


# ---------------------------------------------------------------------------------------------
# Loading, saving, digest


def _schema_at(path: str) -> Any:
    """The annotation of dotted ``path`` in the Config schema (list indices are ignored)."""
    tp: Any = Config
    for part in re.sub(r"\[\d+\]", "", path).split(".") if path else []:
        if not dataclasses.is_dataclass(tp):
            return Any
        tp = typing.get_type_hints(tp).get(part, Any)
    return tp


def _check_sections(node: Any, cls: type, prefix: str) -> None:
    """Reject a scalar where a section is expected (OmegaConf's merge error names no key)."""
    if not isinstance(node, dict):
        return
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        tp = hints.get(key)
        if tp is not None and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                allowed = ", ".join(f.name for f in dataclasses.fields(tp))
                raise ConfigError(f"config key '{prefix}{key}' is a section; expected a mapping with keys "
                                  f"({allowed}), got {value!r}")
            _check_sections(value, tp, f"{prefix}{key}.")


def _translate(e: OmegaConfBaseException) -> ConfigError:
    """Turn an OmegaConf error into a ConfigError that names the dotted key."""
    full_key = str(getattr(e, "full_key", "") or "")
    if isinstance(e, ConfigKeyError) and full_key:
        section, _, leaf = full_key.rpartition(".")
        tp = _schema_at(section)
        allowed = [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []
        # verl's spellings of this section's keys are accepted too (config/verl_keys.py)
        aliases = [e.verl.rpartition(".")[2] for e in verl_keys.TABLE if e.verl.rpartition(".")[0] == section]
        close = difflib.get_close_matches(leaf, allowed + aliases, n=1)
        hint = f" (did you mean '{section + '.' if section else ''}{close[0]}'?)" if close else ""
        where = f"section '{section}'" if section else "the top level"
        return ConfigError(f"unknown config key '{full_key}'{hint}. Allowed keys in {where}: {', '.join(allowed)}")
    if full_key and isinstance(e, InterpolationResolutionError):
        return ConfigError(f"cannot resolve config key '{full_key}': {getattr(e, 'msg', str(e)).splitlines()[0]}")
    if full_key:
        value = getattr(e, "value", None)
        return ConfigError(f"invalid type for config key '{full_key}': expected {type_name(_schema_at(full_key))}, "
                           f"got {value!r} ({getattr(e, 'msg', str(e)).splitlines()[0]})")
    return ConfigError(f"invalid config: {str(e).splitlines()[0]}")


def _locate(node: DictConfig, owner: type, prefix: str = "") -> Optional[str]:
    """Dotted path of the first section of type ``owner`` (in build order) that fails to build."""
    for key in node.keys():
        child = node[key]
        if not isinstance(child, DictConfig) or not dataclasses.is_dataclass(OmegaConf.get_type(child)):
            continue
        path = f"{prefix}{key}"
        found = _locate(child, owner, path + ".")
        if found is not None:
            return found
        if OmegaConf.get_type(child) is owner:
            try:
                OmegaConf.to_object(child)
            except ConfigFieldError:
                return path
    return None


def _from_verl(layers: Sequence[tuple[DictConfig, str]]) -> tuple[list[DictConfig], dict[str, str]]:
    """The layers with verl's keys turned into this project's (:mod:`resilient_rl.config.verl_keys`),
    and which of our keys were given under a verl name (errors name both). A layer's implied keys
    (``model.kind=hf`` for verl's model path) go just below it: any layer's own value wins. The
    values verl derives from others (sequences from prompts, the context) go on top."""
    translated = [verl_keys.translate(OmegaConf.to_container(layer, resolve=False), where)
                  for layer, where in layers]
    out: list[DictConfig] = []
    for t in translated:
        if t.implied:
            out.append(OmegaConf.create(t.implied))
        out.append(OmegaConf.create(t.explicit))
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(*out), resolve=False) if out else {}
    except OmegaConfBaseException:
        merged = {}  # _build reports what is wrong with the layers
    merged = merged if isinstance(merged, dict) else {}
    # Values verl derives from others: mini-batches counted in prompts, the context from the lengths.
    for derived in (verl_keys.per_prompt_layer(translated, merged, RolloutConfig.n),
                    verl_keys.context_layer(translated, merged, RolloutConfig.max_new_tokens)):
        if derived:
            out.append(OmegaConf.create(derived))
    given_as = {k: v for t in translated for k, v in t.given_as.items()}
    return out, given_as


def _build_verl(layers: Sequence[tuple[DictConfig, str]]) -> Config:
    """:func:`_build` of layers that may use verl's keys; an error about a key given under its
    verl name says so."""
    translated, given_as = _from_verl(layers)
    try:
        return _build(translated)
    except ConfigError as e:
        # The key an error is about is followed by its value or a quote ("lr=-1.0", "'data.path'").
        named = [f"'{ours}' was given as verl's '{verl}'" for ours, verl in given_as.items()
                 if re.search(re.escape(ours) + r"[='\]]", str(e))]
        if not named:
            raise
        raise ConfigError(f"{e} ({'; '.join(named)})") from None


def _build(layers: Sequence[DictConfig]) -> Config:
    for layer in layers:
        _check_sections(OmegaConf.to_container(layer, resolve=False), Config, "")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        return typing.cast(Config, OmegaConf.to_object(merged))
    except ConfigFieldError as e:
        if e.owner is None:
            raise
        prefix = _locate(typing.cast(DictConfig, merged), e.owner)
        raise ConfigFieldError(f"{prefix}.{e.key}" if prefix else e.key, e.value, e.allowed,
                               None if prefix else e.owner) from None
    except OmegaConfBaseException as e:
        raise _translate(e) from None
    except OverflowError as e:  # OmegaConf lets float(<int with 400 digits>) through unwrapped
        key = next((k for layer in layers for k in _huge_ints(OmegaConf.to_container(layer, resolve=False))), None)
        raise ConfigError(f"invalid config value {key or '?'}: {e}") from None


def _huge_ints(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of integers too large for a float (they overflow a float field)."""
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in _huge_ints(value, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [k for i, value in enumerate(node) for k in _huge_ints(value, f"{prefix}[{i}].")]
    if isinstance(node, int) and not isinstance(node, bool) and abs(node) > 1.7976931348623157e308:
        return [prefix.rstrip(".")]
    return []


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (any fsspec URL, or ``pkg://<package>/<path>`` for a
    config shipped inside a package), then ``key=value`` overrides. Both may use verl's keys
    (:mod:`resilient_rl.config.verl_keys`)."""
    layers: list[tuple[DictConfig, str]] = []
    if path is not None:
        path = resolve_path(path, "--config")
        try:
            with fsspec.open(path, "r") as f:
                text = f.read()
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        try:
            layer = OmegaConf.create(text)
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        if not isinstance(layer, DictConfig):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got a {type(layer).__name__}")
        layers.append((layer, f"config file {path}"))
    # Hydra's "+key=value" (add a key) is how verl's command lines set keys its YAML lacks; every
    # key is known here, so adding and setting are the same.
    overrides = [item.lstrip("+") if item.startswith("+") else item for item in overrides]
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            # Not "dotted.key=value": printed through the secret redactor, a key named "key" reads as a credential.
            raise ConfigError(f"override {item!r} must have the form section.field=value, "
                              "e.g. trainer.total_steps=50")
    if overrides:
        try:
            layers.append((OmegaConf.from_dotlist(list(overrides)), "the overrides"))
        except OmegaConfBaseException as e:
            raise _translate(e) from None
    return _build_verl(layers)


def config_from_dict(data: Dict[str, Any]) -> Config:
    """Build and validate a Config from a plain (possibly partial) mapping, e.g. a saved run config
    (verl's keys are accepted, as in :func:`load_config`)."""
    return _build_verl([(OmegaConf.create(data), "the config")])


def config_to_dict(cfg: Config) -> Dict[str, Any]:
    """The config as plain, JSON-serialisable Python data."""
    return dataclasses.asdict(cfg)


def redact_secrets(options: Any) -> Any:
    """``options`` with every credential redacted (:func:`resilient_rl.config.secrets.redact`)."""
    return redact(options)


def _drop_redacted(options: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    """A config read back from a saved ``config.yaml``: redacted credentials are not values;
    drop them so the backend takes credentials from the environment (or the command line)."""
    out = {}
    for key, value in options.items():
        if value == REDACTED:
            logger.warning("%s.%s was redacted when the config was saved; give it on the command line "
                           "or through the environment (e.g. AWS_SECRET_ACCESS_KEY)", prefix, key)
        else:
            out[key] = _drop_redacted(value, f"{prefix}.{key}") if isinstance(value, dict) else value
    return out


def redacted_config_dict(cfg: Config) -> Dict[str, Any]:
    """:func:`config_to_dict` with credentials in ``checkpoint.storage_options`` redacted: what
    is saved with the run and what may be logged."""
    data = config_to_dict(cfg)
    remember_secrets(data)  # the log redacts these values wherever they show up later
    return redact(data)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as YAML to ``path`` (any fsspec URL), credentials redacted;
    load_config reads it back (redacted options then come from the environment)."""
    data = redacted_config_dict(cfg)
    # A takeover is for the start that asked for it: a resume from this file must not silently
    # displace a live controller again.
    data["checkpoint"]["takeover"] = False
    with fsspec.open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)


def config_digest(cfg: Config) -> str:
    """First 16 hex chars of the sha256 of the config's canonical JSON (sorted keys, no spaces).
    Credentials are left out (redacted): rotating a key does not make a resume warn."""
    data = redacted_config_dict(cfg)
    data["checkpoint"].pop("takeover", None)  # one start's choice, not the run's config
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
