"""What a Hugging Face model folder (``model.path``) says about the run, read without its weights.

Two facts the trainer must honour before any worker starts:

- **End-of-sequence ids.** Chat models stop on several tokens (Qwen2.5: ``<|im_end|>`` and
  ``<|endoftext|>``; Llama 3: ``<|eot_id|>``, ``<|eom_id|>`` and ``<|end_of_text|>``). The list lives
  in the folder's ``generation_config.json`` (``eos_token_id``: an int or a list), else in its
  ``config.json``; the tokenizer names only one of them.
- **Context length.** ``model.max_seq_len`` (prompt + response) must not exceed the model's
  ``max_position_embeddings``: past it, rotary models silently extrapolate and learned positions fail.
"""

from __future__ import annotations

import json
import os
from typing import Any

from resilient_rl.errors import ConfigError

__all__ = ["check_max_seq_len", "model_eos_token_ids", "read_folder_json"]


def _folder(model_cfg: Any) -> str | None:
    if getattr(model_cfg, "kind", "tiny") != "hf" or getattr(model_cfg, "path", None) is None:
        return None
    return os.path.expanduser(str(model_cfg.path))


def read_folder_json(path: str, name: str) -> dict[str, Any] | None:
    """``name`` (e.g. ``config.json``) of the model folder ``path`` as a dict; None when absent.
    Raises :class:`ConfigError` naming the file when it is not a JSON object."""
    file = os.path.join(os.path.expanduser(str(path)), name)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path={path!r}: cannot read {name}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"model.path={path!r}: {name} is not a JSON object")
    return data


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where} must be a token id or a list of them, got {value!r}")
    return list(values)


def model_eos_token_ids(model_cfg: Any) -> list[int]:
    """The eos ids the model folder of ``model_cfg`` declares: ``generation_config.json``'s
    ``eos_token_id`` if set, else ``config.json``'s; ``[]`` for the tiny model, a config dict
    (``model.hf_config``'s ``eos_token_id`` is used then) or a folder that names none."""
    folder = _folder(model_cfg)
    if folder is None:
        hf_config = getattr(model_cfg, "hf_config", None) or {}
        return _ids(dict(hf_config).get("eos_token_id"), "model.hf_config.eos_token_id")
    for name in ("generation_config.json", "config.json"):
        data = read_folder_json(folder, name) or {}
        ids = _ids(data.get("eos_token_id"), f"model.path={model_cfg.path!r} {name} eos_token_id")
        if ids:
            return ids
    return []


def check_max_seq_len(model_cfg: Any) -> None:
    """Raise :class:`ConfigError` naming ``model.max_seq_len`` and the folder when the run's
    sequences (``model.max_seq_len``) are longer than the folder's ``max_position_embeddings``."""
    folder = _folder(model_cfg)
    if folder is None:
        return
    config = read_folder_json(folder, "config.json") or {}
    positions = config.get("max_position_embeddings")
    if positions is None:  # some families keep it under their text config
        positions = (config.get("text_config") or {}).get("max_position_embeddings")
    max_seq_len = getattr(model_cfg, "max_seq_len", None)
    if isinstance(positions, int) and isinstance(max_seq_len, int) and max_seq_len > positions:
        raise ConfigError(f"model.max_seq_len={max_seq_len} is longer than the model's context: "
                          f"model.path={model_cfg.path!r} config.json max_position_embeddings={positions}; "
                          f"lower model.max_seq_len (prompt + response tokens) to at most {positions}")
