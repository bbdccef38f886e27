"""Flatten nested state dicts into tensors + JSON, and back, without pickle.

A state such as ``{"model": {...}, "optim": {"state": {...}, "param_groups": [...]}, "rng": ...}``
becomes a flat ``{key: tensor}`` map and a JSON-able ``extras`` dict. Keys join the path
components with ``/`` (FQN dots stay as they are); a ``~`` or ``/`` inside a dict key is escaped
as ``~0`` / ``~1`` (as in JSON Pointer), an int dict key is written ``~i<n>`` and list/tuple
items by their index. ``extras`` holds:

- ``values``: non-tensor leaves (None, bool, int, float, str); a list of such leaves is kept
  whole as a JSON array, a tuple of them as ``{"tuple": [...]}``;
- ``containers``: the dicts, lists and tuples that hold tensors, with their keys in order, so
  :func:`unflatten_state` rebuilds the exact structure (tuples stay tuples, int keys stay ints).

Anything else (numpy arrays, arbitrary objects) is refused with a CheckpointError naming its key,
so nothing ever needs pickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from resilient_rl.errors import CheckpointError

SEP = "/"
_SCALARS = (type(None), bool, int, float, str)


def escape_key(key: str) -> str:
    """Escape a dict key so that it contains no separator."""
    return key.replace("~", "~0").replace("/", "~1")


def unescape_key(component: str) -> str | int:
    """Invert :func:`escape_key` (and decode ``~i<n>`` int keys)."""
    if component.startswith("~i"):
        return int(component[2:])
    return component.replace("~1", "/").replace("~0", "~")


def _child(path: str, component: str) -> str:
    return f"{path}{SEP}{component}" if path else component


def _component(key: Any, path: str) -> str:
    if isinstance(key, str):
        return escape_key(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return f"~i{key}"
    raise CheckpointError(
        f"state key {_child(path, repr(key))!r}: dict keys must be str or int, got {type(key).__name__}")


def _is_scalar_seq(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value)


def flatten_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``state`` into ``{flat_key: tensor}`` (DTensors included, untouched) and extras."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    containers: dict[str, Any] = {}

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
        elif isinstance(value, _SCALARS):
            values[path] = value
        elif _is_scalar_seq(value):
            values[path] = list(value) if isinstance(value, list) else {"tuple": list(value)}
        elif isinstance(value, Mapping):
            components = [_component(k, path) for k in value]
            containers[path] = ["dict", components]
            for comp, item in zip(components, value.values()):
                visit(item, _child(path, comp))
        elif isinstance(value, (list, tuple)):
            containers[path] = ["tuple" if isinstance(value, tuple) else "list", len(value)]
            for i, item in enumerate(value):
                visit(item, _child(path, str(i)))
        else:
            raise CheckpointError(
                f"state key {path!r}: cannot checkpoint a value of type {type(value).__name__}; "
                "only tensors, None/bool/int/float/str and dicts/lists/tuples of them are stored")

    visit(state, "")
    return tensors, {"values": values, "containers": containers}


def unflatten_state(tensors: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the nested state from :func:`flatten_state`'s output."""
    values = extras.get("values", {})
    containers = extras.get("containers", {})
    if "" not in containers:
        raise CheckpointError("checkpoint extras have no root container (not written by flatten_state?)")

    def build(path: str) -> Any:
        if path in containers:
            kind, spec = containers[path]
            if kind == "dict":
                return {unescape_key(c): build(_child(path, c)) for c in spec}
            items = [build(_child(path, str(i))) for i in range(int(spec))]
            return tuple(items) if kind == "tuple" else items
        if path in tensors:
            return tensors[path]
        if path in values:
            value = values[path]
            if isinstance(value, dict):
                return tuple(value["tuple"])
            return list(value) if isinstance(value, list) else value
        raise CheckpointError(f"state key {path!r} is in the structure but has no value or tensor")

    return build("")


def is_under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether flat ``key`` equals one of ``prefixes`` or lies below one."""
    return any(key == p or key.startswith(p + SEP) for p in prefixes)
