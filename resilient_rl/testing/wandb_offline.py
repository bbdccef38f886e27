"""Read the history of an offline wandb run (``run-<id>.wandb``) without a network.

wandb has no Python reader for its run files any more (the writer is its Go core) and
``wandb.Api`` needs a server, so tests read the file here: a LevelDB-style log (7-byte file
header ``:W&B`` + magic + version, then 32 KiB blocks of chunks with a 7-byte header each:
crc32, length, type) whose records are ``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a wandb run file (no :W&B header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # the writer pads a block tail too short for a chunk header
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if pos + _HEADER + length > len(data):  # still being written
            break
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        else:  # zero padding at the end of the file
            break


def read_history(path: str | Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The rows logged with ``run.log`` (keys joined with '/', values decoded from JSON), in order.

    wandb's core process may still be writing the file when ``run.finish()`` returns, so this
    waits (up to ``timeout_s``) for the run's ``exit`` record, which is written last.
    """
    import time

    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        rows, finished = [], False
        for raw in _records(Path(path).read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                             for item in rec.history.item})
            finished = finished or kind == "exit"
        if finished:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no exit record after {timeout_s}s (the run was not finished)")
        time.sleep(0.1)


def find_run_file(run_dir: str | Path) -> Path:
    """The single ``wandb/offline-run-*/run-*.wandb`` under ``run_dir``."""
    found = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one offline wandb run under {run_dir}/wandb, found {found}")
    return found[0]
