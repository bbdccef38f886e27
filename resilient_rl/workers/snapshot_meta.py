"""A snapshot's metadata on disk and its checksum: JSON and a tensor layout, never pickle.

A snapshot kept in node memory (:mod:`resilient_rl.workers.node_memory`) is two files: the
packed tensors (``.data``) and everything else (``.meta``): format, step, rank, world size, the
layout of the packed tensors, the non-tensor state (scheduler, optimizer hyperparameters and
scalars, RNG) and the checksum of the data. The ``.meta`` is read by a process that did not
write it (a restarted rank), from a directory other local users may be able to reach, so it is
written as JSON through the same structure-preserving flattening a checkpoint's extras use
(:mod:`resilient_rl.checkpoint.state_tree`: tuples stay tuples, int keys stay ints), with the
RNG state (a byte array) as base64. Loading it can build only dicts, lists, tuples, numbers and
strings.

The checksum (:func:`checksum`, xxHash3 64-bit of the packed bytes, about 15 GB/s on one core) is
computed on the worker's "snapshot" thread after the copy, off the step's path, and checked
before any copy is written into a rank's tensors: a torn or flipped copy is never restored.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import xxhash

from resilient_rl.checkpoint.state_tree import flatten_state, unflatten_state
from resilient_rl.errors import CheckpointError

#: Name of the checksum algorithm, stored with each checksum (a reader refuses one it does not know).
ALGORITHM = "xxh3_64"


def checksum(data: np.ndarray | memoryview, nbytes: int | None = None) -> str:
    """``"xxh3_64:<hex>"`` of the first ``nbytes`` bytes of ``data`` (all of it by default)."""
    view = memoryview(np.ascontiguousarray(np.asarray(data, dtype=np.uint8).reshape(-1))).cast("B")
    if nbytes is not None:
        view = view[:nbytes]
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(view)}"


def verify(snap: dict) -> str | None:
    """Why the packed data of ``snap`` (a snapshot dict with its ``data``) cannot be trusted, or
    None when its checksum matches. A snapshot without a checksum is not trusted either."""
    want = snap.get("checksum")
    if not isinstance(want, str) or not want.startswith(ALGORITHM + ":"):
        return f"no {ALGORITHM} checksum (got {want!r})"
    data = snap.get("data")
    nbytes = int(snap.get("bytes", 0))
    if data is None or np.asarray(data).nbytes < nbytes:
        return f"data is shorter than its {nbytes} bytes"
    got = checksum(data, nbytes)
    return None if got == want else f"checksum {got} does not match the recorded {want}"


def encode(meta: dict) -> bytes:
    """The JSON bytes of a snapshot's metadata (the snapshot without ``data``)."""
    meta = dict(meta)
    extra = dict(meta.get("extra") or {})
    if "rng" in extra:
        extra["rng"] = {"base64": base64.b64encode(np.asarray(extra["rng"], dtype=np.uint8).tobytes()).decode()}
    meta["extra"] = extra
    tensors, extras = flatten_state(meta)
    if tensors:  # every tensor of a snapshot is in its data
        raise CheckpointError(f"snapshot metadata holds tensors at {sorted(tensors)[:3]}")
    return json.dumps(extras, allow_nan=True).encode()


def decode(raw: bytes, where: str) -> dict[str, Any]:
    """Invert :func:`encode`; a CheckpointError naming ``where`` for anything else."""
    try:
        meta = unflatten_state({}, json.loads(raw.decode()))
        rng = meta["extra"].get("rng")
        if rng is not None:
            meta["extra"]["rng"] = np.frombuffer(base64.b64decode(rng["base64"]), dtype=np.uint8).copy()
    except (ValueError, KeyError, TypeError, AttributeError, CheckpointError) as exc:
        raise CheckpointError(f"snapshot metadata {where} is not valid: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"snapshot metadata {where} is not an object")
    return meta
