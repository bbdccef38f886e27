"""verl's RL data as it is: a parquet file of prompts read with pyarrow.

Each row holds ``prompt`` (a list of chat messages ``{"role", "content"}``, rendered by the
tokenizer's chat template; a plain string is taken too), ``reward_model`` (a mapping whose
``ground_truth`` is the reference answer), and optionally ``data_source`` (a string the reward
function is given, naming the dataset), ``ability`` (not used) and ``extra_info`` (a mapping
handed to the reward function as it is). This is the layout verl's ``examples/data_preprocess``
scripts write (GSM8K, MATH, ...).

Bad input fails as the JSONL reader's does (:func:`resilient_rl.data.tasks.read_jsonl`): a
ConfigError naming the file, the row (counted from 0, as pandas numbers them) and the field,
raised while the trainer reads the data, before any worker starts.
"""

from __future__ import annotations

from typing import Any

import fsspec

from resilient_rl.config.paths import resolve_path
from resilient_rl.errors import ConfigError

#: The columns a row must have, and those read when present.
REQUIRED = ("prompt", "reward_model")
OPTIONAL = ("data_source", "extra_info")


def _table(path: str, key: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"{key}={path!r}: reading parquet needs pyarrow: pip install 'resilient-rl[parquet]'") from e
    import pyarrow as pa

    try:
        with fsspec.open(resolve_path(path, key), "rb") as f:
            return pq.read_table(f)
    except (OSError, ValueError, pa.ArrowException) as e:  # missing, unreadable, or not a parquet file
        raise ConfigError(f"{key}={path!r}: cannot read the parquet file: {e}") from e


def _messages(value: Any, where: str) -> Any:
    """The row's prompt: a non-empty string, or a non-empty list of chat messages (a list of dicts)."""
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"{where}: field 'prompt' must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: field 'prompt' must be a list of chat messages {{'role': ..., 'content': ...}} "
                          f"(or a string), got {value!r:.200}")
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}: field 'prompt'[{j}] must be a chat message with string 'role' and "
                              f"'content', got {message!r:.200}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def read_parquet_rows(path: str, key: str = "data.path") -> list[dict[str, Any]]:
    """The rows of verl's parquet file ``path`` (any fsspec URL or ``pkg://package/file``), checked,
    as the fields of :class:`resilient_rl.data.tasks.Sample`: ``prompt``, ``answer`` (the ground
    truth), ``source`` (file: row), ``data_source`` and ``extra_info``. ``key`` is the config key
    that named the file (errors name it)."""
    table = _table(path, key)
    columns = table.column_names
    for column in REQUIRED:
        if column not in columns:
            raise ConfigError(f"{path}: no column {column!r}; verl's RL data has prompt, reward_model "
                              f"(with ground_truth), data_source, ability, extra_info (this file has: "
                              f"{', '.join(columns) or 'none'})")
    rows = table.select([c for c in REQUIRED + OPTIONAL if c in columns]).to_pylist()
    samples = []
    for i, row in enumerate(rows):
        where = f"{path}: row {i}"
        prompt = _messages(row["prompt"], where)
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise ConfigError(f"{where}: field 'reward_model' must be a mapping with a 'ground_truth', "
                              f"got {reward_model!r:.200}")
        data_source = row.get("data_source")
        if data_source is not None and not isinstance(data_source, str):
            raise ConfigError(f"{where}: field 'data_source' must be a string, got {data_source!r:.200}")
        extra_info = row.get("extra_info")
        if extra_info is not None and not isinstance(extra_info, dict):
            raise ConfigError(f"{where}: field 'extra_info' must be a mapping, got {extra_info!r:.200}")
        samples.append(dict(prompt=prompt, answer=reward_model["ground_truth"], source=where,
                            data_source=data_source, extra_info=extra_info))
    if not samples:
        raise ConfigError(f"{key}={path!r}: the parquet file holds no rows")
    return samples
