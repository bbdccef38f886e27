"""verl's config keys: the one table that maps each to this project's key, or says it has none.

A verl user brings a command line or a YAML file written for verl's ``ppo_trainer.yaml``. Every
verl key whose concept this project has is accepted as an alias of the project's key (the config
saved with a run names the project's keys only); the values verl counts differently are
converted (``ppo_mini_batch_size`` counts prompts, ``actor.mini_batch_size`` sequences; a
``save_freq`` of -1 is a ``save_every`` of 0). A verl key without a counterpart is a ConfigError
that names it and says so, unless its value asks for what this project does anyway
(``reward_model.enable=false``). The table is :data:`resilient_rl.config.verl_table.TABLE`;
:func:`translate` applies it to one layer of the config (a YAML file or the overrides);
:func:`markdown_table` renders it for the README.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional

from resilient_rl.config.verl_table import DROP, TABLE, VerlKey
from resilient_rl.errors import ConfigError

__all__ = ["DROP", "TABLE", "VerlKey", "context_layer", "lookup", "markdown_table", "per_prompt_layer", "translate"]

_BY_KEY = {entry.verl: entry for entry in TABLE}
_SUBTREES = tuple(entry for entry in TABLE if entry.subtree)
#: Every section verl has: a key under one that is neither in the table nor this project's is
#: named as an unknown verl key.
_PREFIXES = {entry.verl.rsplit(".", i)[0] for entry in TABLE for i in range(1, entry.verl.count(".") + 1)}
#: Top-level sections only verl has.
VERL_ONLY = ("actor_rollout_ref", "reward_model", "ray_init")


def lookup(key: str) -> Optional[VerlKey]:
    """The table's entry for dotted verl ``key`` (an entry with ``subtree`` covers keys under it)."""
    if key in _BY_KEY:
        return _BY_KEY[key]
    return next((e for e in _SUBTREES if key.startswith(e.verl + ".")), None)


@dataclass
class Translated:
    """One config layer in this project's keys: ``explicit`` (the layer's own values), ``implied``
    (set by an alias unless another layer gives them: merged just below ``explicit``),
    ``per_prompt`` (keys whose value counts prompts), ``given_as`` (our key -> the verl key)."""

    explicit: dict
    implied: dict
    per_prompt: set
    given_as: dict


def _put(tree: dict, key: str, value: Any) -> None:
    """Set dotted ``key``; a mapping is merged into one already there (``actor: {world_size: 1}``
    after ``actor.optim.lr`` keeps both)."""
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    if isinstance(value, dict) and isinstance(tree.get(leaf), dict):
        for k, v in value.items():
            _put(tree[leaf], k, v)
    else:
        tree[leaf] = value


def _get(tree: dict, key: str, default: Any = None) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def _unknown(key: str) -> str:
    section = key.rsplit(".", 1)[0]
    near = [e.verl for e in TABLE if e.verl.rsplit(".", 1)[0] == section] or [e.verl for e in TABLE]
    close = difflib.get_close_matches(key, near, n=1)
    return f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else "")


def _leaves(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf under ``value`` (itself when it is not a mapping)."""
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{key}.{k}")]
    return [(key, value)]


def _is_off(entry: VerlKey, value: Any) -> bool:
    """Whether ``value`` (every leaf of it, for a subtree) is one of ``entry.off``; compared with
    types, so that verl's ``false`` is not taken for a 0."""
    return bool(entry.off) and all(any(type(v) is type(leaf) and v == leaf for v in entry.off)
                                   for _, leaf in _leaves(value))


def translate(layer: dict, where: str) -> Translated:
    """``layer`` (nested plain data, as OmegaConf reads it) with verl's keys turned into ours.

    Raises one ConfigError naming every verl key of the layer that has no counterpart (and every
    unknown key under a section only verl has), and for two keys that set one of ours to
    different values. ``where`` names the layer in errors ("the overrides", a file)."""
    out = Translated({}, {}, set(), {})
    missing: list[str] = []
    unknown: list[str] = []
    source: dict[str, str] = {}

    def set_ours(ours: str, value: Any, given: str) -> None:
        if ours in source and _get(out.explicit, ours, DROP) != value:
            raise ConfigError(f"{where}: '{source[ours]}' and '{given}' both set '{ours}', to different values "
                              f"({_get(out.explicit, ours)!r} and {value!r}); give one")
        source[ours] = given
        _put(out.explicit, ours, value)

    def walk(node: dict, prefix: str) -> None:
        for raw_key, value in node.items():
            key = f"{prefix}{raw_key}"
            entry = lookup(key)
            if isinstance(value, dict) and key in _PREFIXES:
                walk(value, key + ".")  # before a subtree's entry: keys under it may have their own
            elif entry is not None and entry.ours is None:
                for leaf_key, leaf in _leaves(value, key):
                    if not _is_off(entry, leaf):  # an "off" value asks for what this project does anyway
                        missing.append(f"'{leaf_key}'" + (f" ({entry.note})" if entry.note else ""))
            elif entry is not None:
                converted = entry.convert(value) if entry.convert is not None else value
                if converted is DROP:
                    continue
                set_ours(entry.ours, converted, key)
                if key != entry.ours:
                    out.given_as[entry.ours] = key
                if entry.per_prompt:
                    out.per_prompt.add(entry.ours)
                for implied_key, implied_value in entry.implies:
                    _put(out.implied, implied_key, implied_value)
            elif key.split(".")[0] in VERL_ONLY:
                unknown.append(_unknown(key))
            else:
                set_ours(key, value, key)

    walk(layer, "")
    if missing or unknown:
        parts = []
        if missing:
            parts.append("verl keys with no counterpart in resilient-rl: " + ", ".join(missing)
                         + ". Remove them (README: 'Coming from verl' lists every key)")
        if unknown:
            parts.append("unknown verl config keys: " + ", ".join(unknown))
        raise ConfigError(f"{where}: " + "; ".join(parts))
    return out


def per_prompt_layer(translated: list[Translated], merged: dict, default_n: int) -> dict:
    """The values of verl's prompt-counted keys in sequences (times ``rollout.n`` of the merged
    config, ``default_n`` when unset), for each such key whose last setting came through verl's key."""
    n = _get(merged, "rollout.n", default_n)
    out: dict = {}
    for key in {k for t in translated for k in t.per_prompt}:
        last = next((t for t in reversed(translated) if _get(t.explicit, key, DROP) is not DROP), None)
        value = _get(last.explicit, key) if last is not None else None
        if last is not None and key in last.per_prompt and isinstance(value, int) and isinstance(n, int):
            _put(out, key, value * n)
    return out


def context_layer(translated: list[Translated], merged: dict, default_response: int) -> dict:
    """verl's context is ``data.max_prompt_length + data.max_response_length``: when a layer gives
    ``data.max_prompt_length`` and none gives ``model.max_seq_len``, the model's context is that
    sum (with ``rollout.max_new_tokens`` of the merged config, ``default_response`` when unset)."""
    given = [t for t in translated if _get(t.explicit, "data.max_prompt_length", DROP) is not DROP]
    if not given or any(_get(t.explicit, "model.max_seq_len", DROP) is not DROP for t in translated):
        return {}
    prompt, response = _get(merged, "data.max_prompt_length"), _get(merged, "rollout.max_new_tokens", default_response)
    if not isinstance(prompt, int) or not isinstance(response, int) or isinstance(prompt, bool):
        return {}  # the schema names what is wrong with them
    return {"model": {"max_seq_len": prompt + response}}


def markdown_table() -> str:
    """The table as Markdown rows for the README (verl key, resilient-rl key, note)."""
    rows = ["| verl key | resilient-rl key | note |", "|---|---|---|"]
    for e in TABLE:
        ours = f"`{e.ours}`" if e.ours else "no counterpart"
        note = e.note
        if e.off:
            note = (note + "; " if note else "") + "accepted when " + " or ".join(
                "null" if v is None else str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str)
                else str(v) for v in e.off)
        rows.append(f"| `{e.verl}{'.*' if e.subtree else ''}` | {ours} | {note} |")
    return "\n".join(rows)
