"""Hugging Face causal LMs: loading from a local directory or building from a config dict.

Nothing is ever downloaded: a path is loaded with ``local_files_only=True`` and a config dict is
built with ``AutoConfig.for_model``. ``transformers`` is an optional dependency (``resilient-rl[hf]``),
imported only when a Hugging Face model is asked for.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from resilient_rl.errors import ConfigError
from resilient_rl.models.varlen_hf import use_varlen_attention

__all__ = ["hf_layers", "import_hf_model_code", "load_hf_causal_lm", "load_hf_config", "tiny_llama_config"]

# Where decoder families keep their block list, tried in order; the first ModuleList found wins.
_LAYER_PATHS = (
    "model.layers",          # Llama, Qwen2/3, Mistral, Gemma, Phi3 (causal LM)
    "layers",                # their base models, and the built-in tiny model
    "transformer.h",         # GPT-2, GPT-J, Falcon, Bloom (causal LM)
    "h",                     # their base models
    "gpt_neox.layers",       # GPT-NeoX, Pythia
    "model.decoder.layers",  # OPT
    "decoder.layers",
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is installed in dev setups
        raise ConfigError("model.kind='hf' needs the transformers package: "
                          "pip install 'resilient-rl[hf]'") from exc
    return transformers


def load_hf_causal_lm(path: str | None = None, hf_config: dict[str, Any] | None = None,
                      dtype: torch.dtype = torch.float32, weights: bool = True) -> nn.Module:
    """Load a causal LM from the local directory ``path`` or build one from ``hf_config``.

    Exactly one of ``path`` and ``hf_config`` must be given. ``hf_config`` is a dict of
    ``AutoConfig.for_model`` arguments and must hold ``model_type`` (see :func:`tiny_llama_config`);
    a model built from it has random weights drawn from the global torch RNG. ``weights=False``
    builds a model from ``path``'s config without reading its weights (they are about to be
    overwritten). The model's SDPA attention computes packed rows per sequence
    (:func:`~resilient_rl.models.varlen_hf.use_varlen_attention`). Raises :class:`ConfigError` naming
    the path when it does not exist or holds no loadable model.
    """
    if (path is None) == (hf_config is None):
        raise ConfigError("set exactly one of model.path (a local model directory) and model.hf_config "
                          f"(a config dict); got path={path!r}, hf_config={'set' if hf_config else hf_config!r}")
    transformers = _transformers()
    if path is not None and not weights:
        model = transformers.AutoModelForCausalLM.from_config(load_hf_config(path), dtype=dtype)
    elif path is not None:
        local = os.path.expanduser(str(path))
        if not os.path.exists(local):
            raise ConfigError(f"model.path={path!r} does not exist (models are loaded from local "
                              "files only, never downloaded)")
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(local, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model.path={path!r} holds no loadable causal LM: {exc}") from exc
    else:
        assert hf_config is not None
        kwargs = dict(hf_config)
        model_type = kwargs.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.hf_config.model_type is missing (e.g. 'llama', 'qwen2', 'mistral')")
        try:
            config = transformers.AutoConfig.for_model(model_type, **kwargs)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"model.hf_config (model_type={model_type!r}) cannot build a causal "
                              f"LM: {exc}") from exc
    use_varlen_attention(model)
    return model


def import_hf_model_code(path: str | None = None, hf_config: dict[str, Any] | None = None) -> None:
    """Import what :func:`load_hf_causal_lm` will for the same arguments: transformers, and the
    modeling module of the model type that ``path``'s config or ``hf_config`` names (transformers
    imports each model family's code at first use, about a second on a CPU core). Builds nothing."""
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = load_hf_config(path).model_type if path is not None else dict(hf_config or {}).get("model_type")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is not None:
        getattr(transformers, name)


def load_hf_config(path: str) -> Any:
    """The ``transformers`` config of the local model directory ``path`` (no weights are read)."""
    transformers = _transformers()
    local = os.path.expanduser(str(path))
    if not os.path.exists(local):
        raise ConfigError(f"model.path={path!r} does not exist (models are loaded from local "
                          "files only, never downloaded)")
    try:
        return transformers.AutoConfig.from_pretrained(local, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.path={path!r} holds no loadable model config: {exc}") from exc


def hf_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks of ``model`` (``model.model.layers`` for Llama/Qwen/Mistral).

    Works on causal LMs and on their base models; FSDP2 shards each of these blocks and then
    the root. Raises :class:`ConfigError` naming the class when no block list is found.
    """
    for dotted in _LAYER_PATHS:
        obj: Any = model
        for name in dotted.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} "
                      f"(looked for: {', '.join(_LAYER_PATHS)})")


def tiny_llama_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      intermediate_size: int = 128, max_position_embeddings: int = 128) -> dict[str, Any]:
    """An ``hf_config`` dict for a tiny random Llama (tests and local runs; nothing is downloaded)."""
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
    }
