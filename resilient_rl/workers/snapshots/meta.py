"""A snapshot's metadata on disk and its checksum: JSON and a tensor layout, never pickle.

A snapshot kept in node memory (:mod:`resilient_rl.workers.snapshots.node_memory`) is two files: the
packed tensors (``.data``) and everything else (``.meta``): format, step, rank, world size, the
layout of the packed tensors, the non-tensor state (optimizer hyperparameters and scalars, the
plain parts of the rank's state: schedule, RNG, ...) and the checksum of the data. The ``.meta`` is read by a process that did not
write it (a restarted rank), from a directory other local users may be able to reach, so it is
written as JSON through the same structure-preserving flattening a checkpoint's extras use
(:mod:`resilient_rl.checkpoint.state_tree`: tuples stay tuples, int keys stay ints), with the
small tensors of the plain parts (the RNG state) as base64 with their dtype and shape. Loading it can build only dicts, lists, tuples, numbers and
strings.

The checksum (:func:`checksum`) is computed on the worker's "snapshot" thread after the copy, off
the step's path, and checked before any copy is written into a rank's tensors: a torn or flipped
copy is never restored. It is xxHash3 64-bit over pieces of :data:`PIECE` bytes, hashed on up to
:data:`THREADS` threads (xxhash releases the GIL), then over the pieces' digests: the check is on
a recovery's path, and one core hashes about 12 GB/s, 0.5 s for a 0.5 B actor's 6.5 GB and 1.6 s
for a 1.5 B actor's 18.6 GB. The value does not depend on the number of threads. A checksum of the
whole bytes in one piece (``xxh3_64``, written before) is still checked.
"""

from __future__ import annotations

import base64
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash

from resilient_rl.checkpoint.state_tree import flatten_state, unflatten_state
from resilient_rl.errors import CheckpointError

#: Name of the checksum algorithm, stored with each checksum (a reader refuses one it does not know).
ALGORITHM = "xxh3_64_pieces"
#: The checksum of the whole bytes in one piece, written before :data:`ALGORITHM`: still checked.
WHOLE = "xxh3_64"
#: Bytes of one piece of the checksum (part of the algorithm: changing it changes every value).
PIECE = 64 << 20
#: Threads that hash pieces at once, at most.
THREADS = min(8, os.cpu_count() or 1)

_POOL: list[ThreadPoolExecutor] = []


def _view(data: np.ndarray | memoryview, nbytes: int | None) -> memoryview:
    view = memoryview(np.ascontiguousarray(np.asarray(data, dtype=np.uint8).reshape(-1))).cast("B")
    return view if nbytes is None else view[:nbytes]


def _pieces_digest(view: memoryview) -> str:
    """xxh3_64 over the little-endian xxh3_64 digests of ``view``'s pieces of :data:`PIECE` bytes."""
    pieces = [view[start:start + PIECE] for start in range(0, len(view), PIECE)] or [view]
    if len(pieces) == 1 or THREADS == 1:
        digests = [xxhash.xxh3_64_intdigest(piece) for piece in pieces]
    else:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(THREADS, thread_name_prefix="checksum"))
        digests = list(_POOL[0].map(xxhash.xxh3_64_intdigest, pieces))
    return xxhash.xxh3_64_hexdigest(np.asarray(digests, dtype="<u8").tobytes())


def checksum(data: np.ndarray | memoryview, nbytes: int | None = None, algorithm: str = ALGORITHM) -> str:
    """``"<algorithm>:<hex>"`` of the first ``nbytes`` bytes of ``data`` (all of it by default):
    :data:`ALGORITHM` (the pieces), or :data:`WHOLE` (the bytes in one piece)."""
    view = _view(data, nbytes)
    if algorithm == WHOLE:
        return f"{WHOLE}:{xxhash.xxh3_64_hexdigest(view)}"
    if algorithm != ALGORITHM:
        raise ValueError(f"unknown snapshot checksum algorithm {algorithm!r} (known: {ALGORITHM}, {WHOLE})")
    return f"{ALGORITHM}:{_pieces_digest(view)}"


def verify(snap: dict) -> str | None:
    """Why the packed data of ``snap`` (a snapshot dict with its ``data``) cannot be trusted, or
    None when its checksum matches. A snapshot without a checksum is not trusted either."""
    want = snap.get("checksum")
    algorithm = want.split(":", 1)[0] if isinstance(want, str) and ":" in want else None
    if algorithm not in (ALGORITHM, WHOLE):
        return f"no {ALGORITHM} checksum (got {want!r})"
    data = snap.get("data")
    nbytes = int(snap.get("bytes", 0))
    if data is None or np.asarray(data).nbytes < nbytes:
        return f"data is shorter than its {nbytes} bytes"
    got = checksum(data, nbytes, algorithm)
    return None if got == want else f"checksum {got} does not match the recorded {want}"


_TENSOR_KEYS = {"tensor_base64", "dtype", "shape"}


def _tensors_to_json(value: Any) -> Any:
    """``value`` with every tensor replaced by its bytes (base64), dtype and shape."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"tensor_base64": base64.b64encode(raw).decode(), "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}
    if isinstance(value, dict):
        return {k: _tensors_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_to_json(v) for v in value)
    return value


def _tensors_from_json(value: Any) -> Any:
    """Invert :func:`_tensors_to_json`."""
    if isinstance(value, dict) and set(value) == _TENSOR_KEYS:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {value['dtype']!r}")
        raw = base64.b64decode(value["tensor_base64"])
        shape = [int(n) for n in value["shape"]]
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if isinstance(value, dict):
        return {k: _tensors_from_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_from_json(v) for v in value)
    return value


def encode(meta: dict) -> bytes:
    """The JSON bytes of a snapshot's metadata (the snapshot without ``data``); the tensors of its
    plain parts (the RNG state) as base64."""
    meta = dict(meta)
    extra = dict(meta.get("extra") or {})
    if "states" in extra:
        extra["states"] = _tensors_to_json(extra["states"])
    meta["extra"] = extra
    tensors, extras = flatten_state(meta)
    if tensors:  # every tensor of a snapshot is in its data
        raise CheckpointError(f"snapshot metadata holds tensors at {sorted(tensors)[:3]}")
    return json.dumps(extras, allow_nan=True).encode()


def decode(raw: bytes, where: str) -> dict[str, Any]:
    """Invert :func:`encode`; a CheckpointError naming ``where`` for anything else."""
    try:
        meta = unflatten_state({}, json.loads(raw.decode()))
        if "states" in meta["extra"]:
            meta["extra"]["states"] = _tensors_from_json(meta["extra"]["states"])
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, CheckpointError) as exc:
        raise CheckpointError(f"snapshot metadata {where} is not valid: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"snapshot metadata {where} is not an object")
    return meta
