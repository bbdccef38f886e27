"""DataProto on disk and verl's tensor serialization helpers.

:meth:`DataProto.save_to_disk` writes one safetensors file: the batch's tensors as safetensors
tensors, numeric non-tensor columns as tensors too, and everything else (object columns,
``meta_info``, the batch's shape and device) as JSON in the file's metadata. Loading it never
unpickles anything (verl pickles the whole proto, which runs code from the file on load), so a
non-tensor value that JSON cannot hold (a Python object other than str/int/float/bool/None and
lists/dicts of them) is refused at save time with the key named.

``serialize_single_tensor`` and friends are verl's raw-bytes encoding of a tensor, kept under
verl's names for code that calls them directly.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resilient_rl.errors import DataProtoError

if TYPE_CHECKING:
    from tensordict import TensorDict


_FORMAT = "resilient_rl.DataProto/1"
_META_KEY = "rrl_dataproto"


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, raw bytes as a uint8 array)`` of a tensor."""
    data = obj.detach().cpu().flatten().contiguous().view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data


def deserialize_single_tensor(arr: Any) -> torch.Tensor:
    """The tensor written by :func:`serialize_single_tensor`."""
    dtype, shape, data = arr
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise DataProtoError(f"unknown tensor dtype {dtype!r} in serialized data")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return raw.view(torch_dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """``(batch size, device, {key: encoded tensor})``; nested tensors as ``(layout, [parts])``."""
    items: dict[str, tuple] = {}
    for key, value in batch.items():
        if value.is_nested:
            items[key] = (str(value.layout).removeprefix("torch."),
                          [serialize_single_tensor(t) for t in value.unbind()])
        else:
            items[key] = serialize_single_tensor(value)
    return tuple(batch.batch_size), (str(batch.device) if batch.device is not None else None), items


def deserialize_tensordict(arr: Any) -> TensorDict:
    """The TensorDict written by :func:`serialize_tensordict`."""
    from tensordict import TensorDict

    batch_size, device, items = arr
    decoded = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            decoded[key] = torch.nested.as_nested_tensor([deserialize_single_tensor(p) for p in parts],
                                                         layout=getattr(torch, layout))
        else:
            raise DataProtoError(f"invalid encoding of tensor {key!r}: expected 2 or 3 fields, got {len(value)}")
    return TensorDict(decoded, batch_size=batch_size, device=device)


def _json_value(where: str, value: Any) -> Any:
    """``value`` as JSON can hold it, or DataProtoError naming ``where``."""
    if isinstance(value, np.ndarray):
        # Object arrays go cell by cell (a cell may itself be a list); others as nested lists.
        cells = [_json_value(where, v) for v in value.ravel()] if value.dtype == object else value.tolist()
        return {"__ndarray__": cells, "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_json_value(where, v) for v in value]}
    if isinstance(value, list):
        return [_json_value(where, v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise DataProtoError(f"cannot save {where}: a dict with non-string keys")
        return {k: _json_value(where, v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise DataProtoError(f"cannot save {where}: a {type(value).__name__} value is not JSON data "
                         "(save_to_disk stores no pickles; convert it to str/number/list/dict first)")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__ndarray__" in value:
            if value["dtype"] == "object":
                flat = np.empty(int(np.prod(value["shape"])), dtype=object)
                for i, cell in enumerate(value["__ndarray__"]):
                    flat[i] = _from_json(cell)
                return flat.reshape(value["shape"])
            return np.asarray(value["__ndarray__"], dtype=value["dtype"]).reshape(value["shape"])
        return {k: _from_json(v) for k, v in value.items()}
    return value


def save_to_disk(data: Any, filepath: str | os.PathLike) -> None:
    """Write ``data`` (a :class:`~resilient_rl.protocol.DataProto`) to ``filepath`` as one safetensors
    file (see the module docstring)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    header: dict[str, Any] = {"format": _FORMAT, "batch": None, "non_tensor": {}, "meta_info": None}
    if data.batch is not None:
        header["batch"] = {"size": list(data.batch.batch_size), "keys": list(data.batch.keys()),
                           "device": str(data.batch.device) if data.batch.device is not None else None}
        for key, value in data.batch.items():
            tensors[f"b/{key}"] = value.detach().cpu().contiguous()
    for key, value in data.non_tensor_batch.items():
        if value.dtype != object and value.dtype.kind in "biuf":
            tensors[f"n/{key}"] = torch.from_numpy(np.ascontiguousarray(value))
            header["non_tensor"][key] = {"tensor": True}
        else:
            header["non_tensor"][key] = {"json": _json_value(f"non_tensor_batch[{key!r}]", value)}
    header["meta_info"] = _json_value("meta_info", data.meta_info)
    save_file(tensors, os.fspath(filepath), metadata={_META_KEY: json.dumps(header)})


def load_from_disk(cls: type, filepath: str | os.PathLike) -> Any:
    """Read a DataProto written by :func:`save_to_disk`, as an instance of ``cls``."""
    from safetensors import safe_open
    from tensordict import TensorDict

    path = os.fspath(filepath)
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise DataProtoError(f"cannot read DataProto file {path!r}: {exc} (save_to_disk writes safetensors; "
                             "pickled DataProtos from verl are not loaded)") from exc
    if _META_KEY not in meta:
        raise DataProtoError(f"{path!r} is a safetensors file but not a saved DataProto")
    header = json.loads(meta[_META_KEY])
    if header.get("format") != _FORMAT:
        raise DataProtoError(f"{path!r} holds DataProto format {header.get('format')!r}; this build reads {_FORMAT}")
    batch = None
    if header["batch"] is not None:
        spec = header["batch"]
        batch = TensorDict({k: tensors[f"b/{k}"] for k in spec["keys"]}, batch_size=spec["size"])
        if spec["device"] not in (None, "cpu"):
            batch = batch.to(spec["device"])
    non_tensor = {k: tensors[f"n/{k}"].numpy() if s.get("tensor") else _from_json(s["json"])
                  for k, s in header["non_tensor"].items()}
    return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=_from_json(header["meta_info"]))
