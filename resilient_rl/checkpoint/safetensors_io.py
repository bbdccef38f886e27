"""Streaming safetensors: write header + tensor buffers without building the file in memory,
and read the header back to address each tensor's bytes.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length
N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`` padded with spaces to a multiple of 8, then the tensors' bytes, back to back in
offset order. Files written here are readable by ``safetensors.safe_open``; writing them
ourselves avoids the extra full copy of ``safetensors.torch.save`` and lets the bytes stream to
storage while being hashed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from resilient_rl.errors import CheckpointCorruptError, CheckpointError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

HEADER_PROBE_BYTES = 64 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


def dtype_name(dtype: torch.dtype, key: str = "") -> str:
    """The safetensors name of ``dtype`` (e.g. ``F32``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"tensor {key!r}: dtype {dtype} cannot be stored in safetensors") from None


def dtype_of(name: str, where: str = "") -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointCorruptError(f"{where}: unknown safetensors dtype {name!r}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, any rank)."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def build_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length + padded JSON header for ``tensors``, laid out in iteration order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": dtype_name(t.dtype, key), "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def iter_file_chunks(header: bytes, tensors: Mapping[str, torch.Tensor],
                     chunk_bytes: int = 16 * 1024 * 1024) -> Iterator[memoryview]:
    """Header, then each tensor's bytes in pieces of at most ``chunk_bytes`` (zero-copy)."""
    yield memoryview(header)
    for t in tensors.values():
        view = tensor_bytes(t)
        for start in range(0, len(view), chunk_bytes):
            yield view[start:start + chunk_bytes]


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file (absolute byte offsets)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: tensor entries and the size the file must have."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _uint(value: object) -> int:
    """A non-negative JSON integer (not a bool, not a float), or ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _uint_list(value: object, length: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise ValueError(f"{value!r} is not a list of {length or 'some'} non-negative integers")
    return tuple(_uint(v) for v in value)


def parse_header(probe: bytes, read_rest, where: str, file_size: int | None = None) -> SafetensorsHeader:
    """Parse a header from the file's first bytes (``probe``), calling ``read_rest(start, end)``
    when the header is longer than the probe. With ``file_size`` every extent is checked against
    it before anything is read or allocated. Every inconsistency is a CheckpointCorruptError."""
    if len(probe) < 8:
        raise CheckpointCorruptError(f"{where}: file too short for a safetensors header")
    (n,) = struct.unpack("<Q", probe[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(f"{where}: safetensors header length {n} is implausible")
    if file_size is not None and 8 + n > file_size:
        raise CheckpointCorruptError(f"{where}: safetensors header length {n} runs past the end of the "
                                     f"{file_size}-byte file")
    raw = probe[8:8 + n] if len(probe) >= 8 + n else probe[8:] + read_rest(len(probe), 8 + n)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{where}: safetensors header is not a JSON object")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{where}: safetensors __metadata__ is not a map of strings")
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    end_of_data = 0
    for key, info in obj.items():
        try:
            if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
                raise ValueError("not an object with a string dtype")
            dtype = dtype_of(info["dtype"], where)
            shape = _uint_list(info.get("shape"))
            begin, end = _uint_list(info.get("data_offsets"), 2)
        except ValueError as exc:
            raise CheckpointCorruptError(f"{where}: malformed header entry {key!r} ({exc})") from None
        numel = 1
        for s in shape:
            numel *= s
        if end < begin or end - begin != numel * dtype.itemsize:
            raise CheckpointCorruptError(
                f"{where}: header entry {key!r} spans bytes [{begin}, {end}) for shape {list(shape)} {dtype}")
        if file_size is not None and data_start + end > file_size:
            raise CheckpointCorruptError(
                f"{where}: header entry {key!r} ends at byte {data_start + end}, past the {file_size}-byte file")
        entries[key] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
        end_of_data = max(end_of_data, end)
    return SafetensorsHeader(entries, dict(metadata), data_start, data_start + end_of_data)
