"""Crafted checkpoints (bad headers, indexes and manifests, with checksums that match) read as
``corrupt: <file>: <why>`` and never raise TypeError, OverflowError or MemoryError, nor allocate
what the files do not hold."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from resilient_rl.checkpoint import (CheckpointManager, FileRecord, Storage, gather_full_state, load_shard_into,
                                     stage, write_shard)
from resilient_rl.checkpoint.manifest import Manifest
from resilient_rl.cli import main
from resilient_rl.errors import CheckpointCorruptError

DATA, INDEX = "shard_00000.safetensors", "shard_00000.json"


def _state() -> dict:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, dtype=torch.int64)}


@pytest.fixture
def shard(tmp_path) -> Path:
    write_shard(stage(_state(), 0, world_size=1), Storage(str(tmp_path)), "actor", 0)
    return tmp_path / "actor"


def _records(folder: Path) -> list[FileRecord]:
    """Manifest records that match the (crafted) files: only the content is wrong."""
    return [FileRecord(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir())]


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    raw = json.dumps(edit(header)).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _set(obj: dict, key: str, field: str, value):
    obj[key][field] = value
    return obj


def _load_both_ways(folder: Path) -> list[str]:
    """Load through the export path (allocates from the index) and the restore path; both must
    raise CheckpointCorruptError. Returns the messages."""
    st, records = Storage(str(folder.parent)), _records(folder)
    messages = []
    with pytest.raises(CheckpointCorruptError) as exc:
        gather_full_state(st, folder.name, records, verify=True)
    messages.append(str(exc.value))
    template = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(CheckpointCorruptError) as exc:
        load_shard_into(template, st, folder.name, records, verify=True, rank=0)
    messages.append(str(exc.value))
    return messages


HEADER_CASES = {
    "non-dict JSON": lambda h: [1, 2, 3],
    "metadata not a map": lambda h: {**h, "__metadata__": ["x"]},
    "entry not an object": lambda h: {**h, "w": 5},
    "unknown dtype": lambda h: _set(h, "w", "dtype", "F99"),
    "dtype not a string": lambda h: _set(h, "w", "dtype", ["F32"]),
    "huge shape": lambda h: _set(h, "w", "shape", [10**12, 10**12]),
    "shape overflowing a float": lambda h: _set(h, "w", "shape", [1e400]),
    "negative shape": lambda h: _set(h, "w", "shape", [-3, -4]),
    "float shape": lambda h: _set(h, "w", "shape", [3.0, 4.0]),
    "negative offsets": lambda h: _set(h, "w", "data_offsets", [-48, 0]),
    "offsets overflowing a float": lambda h: _set(h, "w", "data_offsets", [0, 1e400]),
    "offsets past the file": lambda h: _set(h, "w", "data_offsets", [10**9, 10**9 + 48]),
    "three offsets": lambda h: _set(h, "w", "data_offsets", [0, 24, 48]),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_crafted_safetensors_header_is_corrupt(shard, case):
    _rewrite_header(shard / DATA, HEADER_CASES[case])
    for message in _load_both_ways(shard):
        assert DATA in message, message


def test_header_length_past_the_end_of_the_file_is_corrupt(shard):
    path = shard / DATA
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) * 4) + data[8:])
    for message in _load_both_ways(shard):
        assert DATA in message and "past the end" in message, message


def _edit_index(folder: Path, edit) -> None:
    path = folder / INDEX
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _set_tensor(index: dict, field: str, value) -> dict:
    index["tensors"]["w"][field] = value
    return index


INDEX_CASES = {
    "not an object": lambda ix: [ix],
    "huge global shape": lambda ix: _set_tensor(_set_tensor(ix, "global_shape", [10**10, 10**10]),
                                                "shape", [10**10, 10**10]),
    "global shape beyond the chunks": lambda ix: _set_tensor(ix, "global_shape", [30000, 40000]),
    "string in a shape": lambda ix: _set_tensor(ix, "global_shape", ["3", 4]),
    "float in an offset": lambda ix: _set_tensor(ix, "global_offset", [1e400, 0]),
    "unknown kind": lambda ix: _set_tensor(ix, "kind", "weird"),
    "tensor entry not an object": lambda ix: {**ix, "tensors": {"w": [1]}},
    "huge world size": lambda ix: {**ix, "world_size": 10**12},
    "bool rank": lambda ix: {**ix, "rank": True},
    "data file out of the folder": lambda ix: {**ix, "data_file": "../../etc/passwd"},
    "extras not a structure": lambda ix: {**ix, "extras": {"values": 5, "containers": "x"}},
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_crafted_shard_index_is_corrupt(shard, case):
    _edit_index(shard, INDEX_CASES[case])
    for message in _load_both_ways(shard):
        assert str(shard) in message, message


def _committed_run(tmp_path) -> tuple[CheckpointManager, Path]:
    manager = CheckpointManager(str(tmp_path / "ckpt"), "run")
    manager.begin_step(1)
    manager.write_trainer_state(1, {"step": 1})
    st = manager.storage
    records = write_shard(stage(_state(), 0, world_size=1), st, Storage.join("run", "step_00000001", "actor"), 0)
    manager.commit(1, {"actor": records}, {"actor": 1})
    return manager, tmp_path / "ckpt" / "run" / "step_00000001" / "MANIFEST.json"


MANIFEST_CASES = {
    "created_at overflowing a float": lambda m: {**m, "created_at": 10**400},
    "created_at -inf": lambda m: {**m, "created_at": -1e400},
    "created_at nan": lambda m: {**m, "created_at": float("nan")},
    "bool step": lambda m: {**m, "step": True},
    "zero world size": lambda m: {**m, "world_sizes": {"actor": 0}},
    "files not a list": lambda m: {**m, "files": {"a": 1}},
    "negative size": lambda m: {**m, "files": [{**m["files"][0], "size": -1}] + m["files"][1:]},
    "path out of the folder": lambda m: {**m, "files": [{**m["files"][0], "path": "../../x"}] + m["files"][1:]},
    "deeply nested": lambda m: json.loads("[" * 50 + "]" * 50),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_crafted_manifest_is_corrupt_and_the_cli_says_so(tmp_path, capsys, case):
    manager, path = _committed_run(tmp_path)
    edited = MANIFEST_CASES[case](json.loads(path.read_text()))
    text = "[" * 100_000 + "]" * 100_000 if case == "deeply nested" else json.dumps(edited)
    path.write_text(text)
    with pytest.raises(CheckpointCorruptError, match="MANIFEST.json"):
        manager.load_manifest(1)
    assert manager.verify(1).startswith("corrupt: MANIFEST.json: ")
    code = main(["-q", "checkpoints", "list", "run", "--root", str(tmp_path / "ckpt")])
    out, err = capsys.readouterr()
    assert code == 0 and "CORRUPT: MANIFEST.json" in out, out + err
    code = main(["-q", "checkpoints", "verify", "run", "--root", str(tmp_path / "ckpt")])
    assert code == 1 and "corrupt" in capsys.readouterr().err


def test_manifest_from_bytes_accepts_what_it_writes():
    manifest = Manifest(step=3, files=(FileRecord("actor/a", 4, "00"),), world_sizes={"actor": 2})
    assert Manifest.from_bytes(manifest.to_bytes(), "m") == manifest
