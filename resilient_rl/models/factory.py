"""Build the actor/ref/rollout causal LM and the critic from the model config, reproducibly.

``model_cfg`` is any object with the model config's attributes (``kind``, ``path``, ``hf_config``,
``hidden_size``, ``num_layers``, ``num_heads``, ``intermediate_size``, ``max_seq_len``, and optionally
``tie_embeddings``, ``init_std``); missing attributes take the tiny model's defaults. Weights are
built in float32 whatever ``model.dtype`` says: they are the master weights; the compute dtype is
applied by the wrapping (:func:`resilient_rl.workers.fsdp.plan_device`).
Models are built under a forked RNG seeded with ``seed``: the same seed gives the same weights on
every rank and every restart, and building never moves the caller's global RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from resilient_rl.errors import ConfigError
from resilient_rl.models.hf import hf_layers, import_hf_model_code, load_hf_causal_lm, load_hf_config
from resilient_rl.models.hf_folder import check_max_seq_len
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.models.value import CausalLMWithValueHead

__all__ = ["build_causal_lm", "build_value_model", "import_model_code", "model_vocab_size", "parameters_on_meta",
           "seeded_init", "tiny_config", "transformer_blocks"]

_KINDS = ("tiny", "hf")


@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Run the block with the torch RNG seeded to ``seed``, restoring the caller's RNG afterwards."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"model seed must be an int, got {seed!r}")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built in the block get their parameters on the meta device (shape and dtype, no
    memory, no initialisation); buffers stay real, so values computed at construction (rotary
    frequencies) survive. :func:`~resilient_rl.workers.fsdp.wrap_fsdp2` later allocates the
    parameters, sharded, on the compute device, for a restore to fill. Not thread-safe: it patches
    ``nn.Module.register_parameter`` while it lasts (models are built on one thread per process)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes a library set on the parameter
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_causal_lm(model_cfg: Any, vocab_size: int | None, seed: int, empty: bool = False) -> nn.Module:
    """The causal LM described by ``model_cfg`` (tiny or Hugging Face), initialised from ``seed``.

    ``vocab_size`` is the tokenizer's vocabulary: the tiny model uses it as is; a Hugging Face
    config dict without ``vocab_size`` gets it, and a model whose vocabulary is smaller is rejected.
    ``empty``: parameters on the meta device, neither initialised nor read from ``model.path``
    (see :func:`parameters_on_meta`), for a caller that fills every one of them (a restore).
    """
    kind = _kind(model_cfg)
    with seeded_init(seed), _maybe_empty(empty):
        if kind == "tiny":
            return TinyCausalLM(tiny_config(model_cfg, vocab_size))
        return _build_hf(model_cfg, vocab_size, empty)


def import_model_code(model_cfg: Any) -> None:
    """Import what :func:`build_causal_lm` and :func:`build_value_model` will for ``model_cfg``
    (a Hugging Face model's family code; nothing for the tiny model, which is imported already),
    without building anything."""
    if _kind(model_cfg) == "hf":
        import_hf_model_code(getattr(model_cfg, "path", None), getattr(model_cfg, "hf_config", None))


def build_value_model(model_cfg: Any, vocab_size: int | None, seed: int, empty: bool = False) -> CausalLMWithValueHead:
    """The critic: the same backbone as :func:`build_causal_lm` plus a value head, from ``seed``."""
    kind = _kind(model_cfg)
    with seeded_init(seed), _maybe_empty(empty):
        if kind == "tiny":
            backbone: nn.Module = TinyCausalLM(tiny_config(model_cfg, vocab_size))
        else:
            backbone = _build_hf(model_cfg, vocab_size, empty)
        return CausalLMWithValueHead(backbone)


def _maybe_empty(empty: bool) -> contextlib.AbstractContextManager:
    return parameters_on_meta() if empty else contextlib.nullcontext()


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList FSDP2 shards block by block, for a tiny, Hugging Face or value model."""
    if isinstance(model, (TinyCausalLM, CausalLMWithValueHead)):
        return model.layers
    return hf_layers(model)


def tiny_config(model_cfg: Any, vocab_size: int | None) -> TinyLMConfig:
    """The :class:`TinyLMConfig` for ``model_cfg`` (attributes missing from it take the defaults)."""
    if vocab_size is None:
        raise ConfigError("model.kind='tiny' needs the tokenizer's vocab_size")
    defaults = TinyLMConfig(vocab_size=vocab_size)
    fields = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_seq_len",
              "tie_embeddings", "init_std")
    return TinyLMConfig(vocab_size=vocab_size,
                        **{f: _get(model_cfg, f, getattr(defaults, f)) for f in fields})


def _kind(model_cfg: Any) -> str:
    kind = _get(model_cfg, "kind", "tiny")
    if kind not in _KINDS:
        raise ConfigError(f"model.kind must be one of {_KINDS}, got {kind!r}")
    return kind


def _get(model_cfg: Any, name: str, default: Any) -> Any:
    # A config field left as None means "use the default", same as a missing attribute.
    value = getattr(model_cfg, name, None)
    return default if value is None else value


def model_vocab_size(model_cfg: Any, vocab_size: int | None) -> int | None:
    """The vocabulary the model described by ``model_cfg`` will have, for a tokenizer of ``vocab_size`` ids.

    The one place the model's vocabulary is decided: the tiny model and a Hugging Face
    ``hf_config`` without ``vocab_size`` take the tokenizer's; an explicit ``hf_config.vocab_size``
    or a ``model.path``'s ``config.json`` keep theirs, which must not be smaller than the
    tokenizer's (a larger one leaves spare rows the tokenizer never produces). Raises
    :class:`ConfigError` naming the key otherwise. Cheap: a model path's config is read, not its weights.
    """
    if _kind(model_cfg) == "tiny" or vocab_size is None:
        return vocab_size
    path = getattr(model_cfg, "path", None)
    if path is not None:
        config = load_hf_config(path)
        declared, where = getattr(config, "vocab_size", None), f"model.path={path!r} (config.json vocab_size)"
    else:
        declared, where = dict(getattr(model_cfg, "hf_config", None) or {}).get("vocab_size"), "model.hf_config.vocab_size"
    if declared is None:
        return vocab_size
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise ConfigError(f"{where}={declared!r} must be a positive int")
    if declared < vocab_size:
        raise ConfigError(f"{where}={declared} is smaller than the tokenizer's vocabulary ({vocab_size} ids, "
                          "len(tokenizer)): leave hf_config.vocab_size unset to take the tokenizer's, or raise it")
    return declared


def _build_hf(model_cfg: Any, vocab_size: int | None, empty: bool = False) -> nn.Module:
    path = getattr(model_cfg, "path", None)
    hf_config = getattr(model_cfg, "hf_config", None)
    resolved = model_vocab_size(model_cfg, vocab_size)
    if hf_config is not None and resolved is not None and path is None:
        hf_config = {**dict(hf_config), "vocab_size": resolved}
    check_max_seq_len(model_cfg)
    model = load_hf_causal_lm(path=path, hf_config=hf_config, dtype=torch.float32, weights=not empty)
    model_vocab = model.get_input_embeddings().num_embeddings
    if vocab_size is not None and model_vocab < vocab_size:
        raise ConfigError(f"model vocabulary ({model_vocab} embeddings, from "
                          f"{'model.path=' + repr(path) if path else 'model.hf_config'}) is smaller than "
                          f"the tokenizer's vocab_size={vocab_size}")
    return model
