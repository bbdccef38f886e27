"""Helpers behind :class:`~resilient_rl.protocol.DataProto`: strict equality, unions,
column checks, padding, the wire format of its tensors, verl's meta-info merge and its global
switches (:class:`DataProtoConfig`).

They are re-exported by :mod:`resilient_rl.protocol` (verl keeps ``union_tensor_dict`` and friends
in ``verl.protocol``), so importing them from either module works.

The wire format sends every tensor as its raw bytes in a ``uint8`` numpy array, with dtype, shape
and device beside it: numpy has no bfloat16 or float8, raw bytes are exact for every dtype, and
numpy arrays travel out-of-band under pickle protocol 5, so Ray does not copy them into the
pickle stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resilient_rl import env
from resilient_rl.errors import DataProtoError

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = [
    "tensordict_class",
    "values_equal",
    "union_tensor_dict",
    "union_numpy_dict",
    "union_dict",
    "as_object_array",
    "positive_int",
    "tensor_to_wire",
    "tensor_from_wire",
    "batch_to_wire",
    "batch_from_wire",
]


def tensordict_class() -> type[TensorDict]:
    """``tensordict.TensorDict``, imported on first use.

    Importing tensordict imports ``torch._dynamo`` (about as much CPU time as torch itself). A
    process that never touches a batch (the CLI, a health check, a worker before its first
    DataProto arrives) does not pay for it; one that does pays it once, on its first batch.
    """
    from tensordict import TensorDict

    return TensorDict


def values_equal(a: Any, b: Any, _seen: set | None = None) -> bool:
    """Strict equality for tensors, numpy arrays (incl. object and NaN) and nested containers.

    Dtypes and shapes must match too: ``torch.equal`` alone treats float32 and float64 as equal.
    Containers that hold themselves compare equal where their structure is the same: a pair
    already being compared further up counts as equal instead of recursing forever.
    """
    if isinstance(a, (np.ndarray, dict, list, tuple)):
        _seen = set() if _seen is None else _seen
        pair = (id(a), id(b))
        if pair in _seen:
            return True
        _seen.add(pair)
        try:
            return _container_equal(a, b, _seen)
        finally:
            _seen.discard(pair)
    return _container_equal(a, b, _seen)


def _container_equal(a: Any, b: Any, seen: set | None) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.cpu(), b.cpu())) or (
            a.is_floating_point() and bool(torch.allclose(a.cpu(), b.cpu(), 0.0, 0.0, equal_nan=True)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        return all(values_equal(x, y, seen) for x, y in zip(a.flat, b.flat))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], seen) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y, seen) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a truth value are not equal
        return False


def union_tensor_dict(td1: TensorDict, td2: TensorDict) -> TensorDict:
    """Add the tensors of ``td2`` to ``td1`` in place; a shared key must hold equal tensors."""
    if td1.batch_size != td2.batch_size:
        raise DataProtoError(f"cannot union tensor dicts with batch sizes {tuple(td1.batch_size)} "
                             f"and {tuple(td2.batch_size)}")
    for key in td2.keys():
        if key in td1.keys() and not values_equal(td1[key], td2[key]):
            raise DataProtoError(f"cannot union: batch key {key!r} is present in both with different values")
    for key in td2.keys():
        if key not in td1.keys():
            td1[key] = td2[key]
    return td1


def union_dict(d1: dict[str, Any], d2: dict[str, Any], kind: str) -> dict[str, Any]:
    """Add the entries of ``d2`` to ``d1`` in place; a shared key must hold equal values.

    ``kind`` names the dict in the error (``"non-tensor"``, ``"meta_info"``).
    """
    for key, val in d2.items():
        if key in d1 and not values_equal(d1[key], val):
            raise DataProtoError(f"cannot union: {kind} key {key!r} is present in both with different values "
                                 f"(`{key}` in tensor_dict1 and tensor_dict2 are not the same object.)")
    d1.update(d2)
    return d1


def union_numpy_dict(d1: dict[str, np.ndarray], d2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of ``d2`` to ``d1`` in place; a shared key must hold equal arrays."""
    return union_dict(d1, d2, "non-tensor")


def as_object_array(key: str, value: Any) -> np.ndarray:
    """A non-tensor column as a numpy array; lists become 1-D object arrays (one cell per row)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        # Filled cell by cell so a list of equal-length lists stays 1-D instead of becoming 2-D.
        out = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            out[i] = item
        return out
    raise DataProtoError(f"non-tensor {key!r} must be a numpy array or a list, got {type(value).__name__}")


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int, or DataProtoError naming ``name`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise DataProtoError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def tensor_to_wire(tensor: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor as a uint8 numpy array (numpy has no bfloat16/float8: bytes are exact)."""
    t = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_from_wire(key: str, raw: np.ndarray, dtype: torch.dtype, shape: torch.Size,
                      device: torch.device) -> torch.Tensor:
    # Buffers received zero-copy (Ray object store, bytes) are read-only; torch needs writable memory.
    if not raw.flags.writeable:
        raw = raw.copy()
    tensor = torch.from_numpy(raw).view(dtype).reshape(shape)
    if device.type == "cpu":
        return tensor
    try:
        return tensor.to(device)
    except (RuntimeError, AssertionError) as exc:  # e.g. a CUDA tensor arriving in a CPU-only process
        raise DataProtoError(f"cannot restore batch key {key!r} on {device} here ({exc}); "
                             "move the DataProto to('cpu') before sending it") from exc


def batch_to_wire(batch: TensorDict | None) -> dict[str, Any] | None:
    """The picklable state of a batch: each tensor as raw bytes plus its dtype, shape and device.

    The byte arrays are numpy arrays, which pickle protocol 5 (and so Ray) sends out-of-band
    instead of copying them into the pickle stream.
    """
    if batch is None:
        return None
    return {
        "batch_size": tuple(batch.batch_size),
        "device": batch.device,
        "tensors": [(k, v.dtype, tuple(v.shape), v.device, tensor_to_wire(v)) for k, v in batch.items()],
    }


def batch_from_wire(state: dict[str, Any] | None) -> TensorDict | None:
    """Rebuild the batch written by :func:`batch_to_wire`."""
    if state is None:
        return None
    tensors = {k: tensor_from_wire(k, raw, dtype, torch.Size(shape), dev)
               for k, dtype, shape, dev, raw in state["tensors"]}
    return tensordict_class()(tensors, batch_size=list(state["batch_size"]), device=state["device"])


class _DataProtoConfigMeta(type):
    """Class-level switches, read and set as ``DataProtoConfig.auto_padding`` (as in verl)."""

    _config: dict[str, Any] = {}
    #: meta_info key that turns auto-padding on for one DataProto (verl's key).
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        by_env = (env.get("VERL_AUTO_PADDING", "FALSE") or "").upper() in ("TRUE", "1")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Global DataProto switches: ``DataProtoConfig.auto_padding = True`` lets every ``chunk`` split
    uneven batches (the ``VERL_AUTO_PADDING`` environment variable does the same)."""


def list_of_dict_to_dict_of_list(items: Sequence[dict]) -> dict[str, list]:
    """``[{"a": 1}, {"a": 2}]`` -> ``{"a": [1, 2]}`` (keys of the first dict, as in verl)."""
    if not items:
        return {}
    out: dict[str, list] = {k: [] for k in items[0]}
    for i, item in enumerate(items):
        for key in out:
            if key not in item:
                raise DataProtoError(f"metrics of part {i} have no key {key!r}; part 0 has {sorted(out)}")
            out[key].append(item[key])
    return out


def merge_meta_info(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """verl's concat rule: keys of every part are merged (a key held by several parts must have
    one value); ``metrics`` of every part (a dict or a list of dicts) become one dict of lists."""
    merged: dict[str, Any] = {}
    metrics: list = []
    for meta in metas:
        for key, value in meta.items():
            if key == "metrics":
                if value is not None:
                    metrics.extend(value if isinstance(value, list) else [value])
            elif key in merged:
                if not values_equal(merged[key], value):
                    raise DataProtoError(f"Conflicting values for meta_info key '{key}' "
                                         f"({merged[key]!r} vs {value!r})")
            else:
                merged[key] = value
    if metrics:
        merged["metrics"] = list_of_dict_to_dict_of_list(metrics) if all(isinstance(m, dict) for m in metrics) \
            else metrics
    return merged
