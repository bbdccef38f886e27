"""Read path of sharded checkpoints: find the saved chunks overlapping a rank's region and
copy their bytes into its tensors, verifying sizes and checksums on the way.

A saved chunk of a tensor is a box ``[offset, offset + shape)`` of the global tensor, stored
row-major in a safetensors file, so the rows ``[r0, r1)`` of a chunk are one contiguous byte
range. For each (target, chunk) overlap the reader fetches exactly those rows; when the overlap
spans whole rows on both sides the bytes land directly in the target's memory, otherwise they
go through a temporary buffer and a strided copy. With a manifest and ``verify``, each file is
read from first to last byte (the unused parts into scratch buffers) and hashed as it streams,
so a flipped bit anywhere is caught without a second pass.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from resilient_rl.checkpoint.manifest import FORMAT_VERSION, FileRecord
from resilient_rl.checkpoint.safetensors_io import (
    HEADER_PROBE_BYTES, SafetensorsHeader, dtype_of, parse_header, tensor_bytes,
)
from resilient_rl.checkpoint.state_tree import is_under
from resilient_rl.checkpoint.hashing import Sha256Pipe
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.errors import CheckpointCorruptError, CheckpointNotFoundError

_INDEX_RE = re.compile(r"^shard_(\d{5,})\.json$")
_DATA_RE = re.compile(r"^shard_\d{5,}\.safetensors$")  # a name in the folder, never a path out of it
_KINDS = ("shard", "replicated", "local")


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _uints(value: Any) -> tuple[int, ...]:
    """A JSON list of non-negative integers as a tuple, or ValueError."""
    if not isinstance(value, list) or not all(_is_uint(v) for v in value):
        raise ValueError(f"{str(value)[:80]} is not a list of non-negative integers")
    return tuple(value)
SCRATCH_BYTES = 16 * 1024 * 1024
GROUP_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SavedChunk:
    """One saved chunk of a tensor, as listed in a rank's index."""

    rank: int
    file: str
    kind: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class ReadTarget:
    """A tensor to fill: ``dest`` holds the region ``[offset, offset + dest.shape)`` of the
    global tensor of shape ``global_shape`` saved under ``key``."""

    key: str
    dest: torch.Tensor
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]


def _records_by_name(files: list[FileRecord] | None, dir_name: str) -> dict[str, FileRecord] | None:
    """Manifest records of the files directly in the folder, keyed by file name. Records are
    relative to the folder, or (a whole step's list) to its parent: ``role/shard_00000.json``."""
    if files is None:
        return None
    split = [(rec, rec.path.strip("/").split("/")) for rec in files]
    if any(len(parts) > 1 for _, parts in split):
        return {parts[1]: rec for rec, parts in split if len(parts) == 2 and parts[0] == dir_name}
    return {parts[0]: rec for rec, parts in split}


class CheckpointDir:
    """The shard indexes of one checkpoint folder (one role of one step)."""

    def __init__(self, storage: Storage, dir_path: str, manifest_files: list[FileRecord] | None,
                 verify: bool = True):
        self.storage = storage
        self.dir_path = dir_path
        self.where = storage.url_for(dir_path)
        self.verify = verify
        dir_name = self.where.rstrip("/").rsplit("/", 1)[-1]
        self.records = _records_by_name(manifest_files, dir_name)
        self.sizes = storage.find(dir_path)
        names = self.records if self.records is not None else self.sizes
        if self.records is not None:
            for name, rec in self.records.items():
                self._check_size(name, rec.size)
        index_names = sorted(n for n in names if _INDEX_RE.match(n))
        if not index_names:
            err = CheckpointCorruptError if self.records else CheckpointNotFoundError
            raise err(f"{self.where}: no shard index (shard_*.json) found")
        self.indexes: dict[int, dict[str, Any]] = {}
        for name in index_names:
            index = self._load_index(name)
            self.indexes[index["rank"]] = index
        sizes = {ix["world_size"] for ix in self.indexes.values()}
        self.world_size = max(sizes)
        # Compared without building range(world_size): a crafted index may claim a huge one.
        if len(sizes) > 1 or len(self.indexes) != self.world_size or not all(
                0 <= r < self.world_size for r in self.indexes):
            raise CheckpointCorruptError(
                f"{self.where}: shard indexes are inconsistent: ranks {sorted(self.indexes)[:8]} with "
                f"world sizes {sorted(sizes)[:8]}")
        self.chunks: dict[str, list[SavedChunk]] = defaultdict(list)
        for rank, index in sorted(self.indexes.items()):
            for key, meta in index["tensors"].items():
                self.chunks[key].append(self._chunk(rank, index, key, meta))
        self._check_extents()
        self._headers: dict[str, SafetensorsHeader] = {}

    # ------------------------------------------------------------- metadata
    def _check_size(self, name: str, expected: int) -> None:
        if name not in self.sizes:
            raise CheckpointCorruptError(f"{self.where}: {name}: file is missing")
        if self.sizes[name] != expected:
            raise CheckpointCorruptError(
                f"{self.where}: {name}: size {self.sizes[name]} differs from the manifest's {expected}")

    def _load_index(self, name: str) -> dict[str, Any]:
        if name not in self.sizes:
            raise CheckpointCorruptError(f"{self.where}: {name}: file is missing")
        raw = self.storage.read_bytes(Storage.join(self.dir_path, name))
        self._check_digest(name, hashlib.sha256(raw).hexdigest())
        try:
            index = json.loads(raw)
            ok = (index["format_version"] == FORMAT_VERSION and _is_uint(index["rank"])
                  and _is_uint(index["world_size"]) and index["world_size"] >= 1
                  and isinstance(index["tensors"], dict) and isinstance(index["extras"], dict)
                  and isinstance(index["extras"].get("values", {}), dict)
                  and isinstance(index["extras"].get("containers", {}), dict)
                  and isinstance(index["data_file"], str) and _DATA_RE.match(index["data_file"]) is not None
                  and isinstance(index.get("rank_local") or [], list)
                  and all(isinstance(p, str) for p in index.get("rank_local") or []))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CheckpointCorruptError(f"{self.where}: {name}: malformed shard index ({exc!r})") from exc
        if not ok:
            raise CheckpointCorruptError(f"{self.where}: {name}: malformed or unsupported shard index")
        if index["rank"] in self.indexes:
            raise CheckpointCorruptError(f"{self.where}: {name}: rank {index['rank']} has two indexes")
        index["rank_local"] = tuple(index.get("rank_local") or ())
        return index

    def _check_digest(self, name: str, digest: str) -> None:
        rec = self.records.get(name) if self.records is not None else None
        if self.verify and rec is not None and rec.sha256 != digest:
            raise CheckpointCorruptError(f"{self.where}: {name}: sha256 mismatch (file is corrupt)")

    def _chunk(self, rank: int, index: dict[str, Any], key: str, meta: Any) -> SavedChunk:
        where = f"{self.where}: shard_{rank:05d}.json: key {key!r}"
        try:
            if not isinstance(meta, dict) or meta.get("kind") not in _KINDS or not isinstance(meta.get("dtype"), str):
                raise ValueError("not an object with a known kind and a dtype")
            chunk = SavedChunk(rank, index["data_file"], meta["kind"], dtype_of(meta["dtype"], where),
                               _uints(meta.get("global_shape")), _uints(meta.get("global_offset")),
                               _uints(meta.get("shape")))
        except ValueError as exc:
            raise CheckpointCorruptError(f"{where}: malformed entry ({exc})") from None
        if not (len(chunk.global_shape) == len(chunk.offset) == len(chunk.shape)) or any(
                o < 0 or o + s > g for o, s, g in zip(chunk.offset, chunk.shape, chunk.global_shape)):
            raise CheckpointCorruptError(f"{where}: chunk lies outside its tensor")
        return chunk

    def _check_extents(self) -> None:
        """Bound what loading may allocate by the bytes actually stored: the chunks an index
        lists must fit in its data file, and a tensor's global shape must be covered by its
        chunks, so a crafted index cannot make a reader allocate more than the files hold."""
        listed: dict[str, int] = defaultdict(int)
        for key, chunks in self.chunks.items():
            first = chunks[0]
            where = f"{self.where}: key {key!r}"
            if any((c.global_shape, c.dtype, c.kind) != (first.global_shape, first.dtype, first.kind)
                   for c in chunks):
                raise CheckpointCorruptError(f"{where}: its chunks disagree on global shape, dtype or kind")
            for c in chunks:
                listed[c.file] += math.prod(c.shape) * c.dtype.itemsize
            if first.kind == "local":
                covered = min(math.prod(c.shape) for c in chunks)
            else:
                covered = sum(math.prod(shape) for _, shape in {(c.offset, c.shape) for c in chunks})
            if math.prod(first.global_shape) > covered:
                raise CheckpointCorruptError(
                    f"{where}: global shape {list(first.global_shape)} is larger than its saved chunks "
                    f"({covered} elements)")
        for file, nbytes in sorted(listed.items()):
            if file not in self.sizes:
                raise CheckpointCorruptError(f"{self.where}: {file}: file is missing")
            if nbytes > self.sizes[file]:
                raise CheckpointCorruptError(
                    f"{self.where}: {file}: the shard indexes list {nbytes} bytes of tensors in it, but it "
                    f"has {self.sizes[file]} bytes")

    def index_files(self) -> list[str]:
        return [f"shard_{r:05d}.json" for r in sorted(self.indexes)]

    def tensor_keys(self) -> set[str]:
        return set(self.chunks)

    def global_meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        chunk = self.chunks[key][0]
        return chunk.global_shape, chunk.dtype

    def _source_rank(self, rank: int) -> int:
        return rank if rank in self.indexes else rank % self.world_size

    def chunks_for(self, key: str, rank: int) -> list[SavedChunk]:
        """The chunks that make up ``key`` for ``rank`` (rank-local tensors: its own only)."""
        chunks = self.chunks[key]
        if chunks and chunks[0].kind == "local":
            src = self._source_rank(rank)
            return [c for c in chunks if c.rank == src]
        unique = {(c.offset, c.shape): c for c in chunks}  # replicas saved twice count once
        return list(unique.values())

    def extras_for(self, rank: int) -> dict[str, Any]:
        """Non-tensor values and structure: rank 0's, with ``rank_local`` subtrees of ``rank``."""
        base = self.indexes[0]["extras"]
        prefixes = self.indexes[0]["rank_local"]
        src = self._source_rank(rank)
        if not prefixes or src == 0:
            return base
        own = self.indexes[src]["extras"]
        merged: dict[str, Any] = {}
        for part in ("values", "containers"):
            merged[part] = {k: v for k, v in base.get(part, {}).items() if not is_under(k, prefixes)}
            merged[part].update({k: v for k, v in own.get(part, {}).items() if is_under(k, prefixes)})
        return merged

    def header(self, file: str) -> SafetensorsHeader:
        if file not in self._headers:
            path = Storage.join(self.dir_path, file)
            where = f"{self.where}: {file}"
            if file not in self.sizes:
                raise CheckpointCorruptError(f"{where}: file is missing")
            probe = self.storage.read_bytes(path, 0, min(HEADER_PROBE_BYTES, self.sizes[file]))
            header = parse_header(probe, lambda s, e: self.storage.read_bytes(path, s, e), where, self.sizes[file])
            if header.file_size != self.sizes[file]:
                raise CheckpointCorruptError(
                    f"{where}: size {self.sizes[file]} differs from the {header.file_size} its header describes")
            self._headers[file] = header
        return self._headers[file]


class _Piece:
    """The bytes of one (target, chunk) overlap: read into ``view``; ``finish`` places them."""

    def __init__(self, start: int, view: memoryview, finish: Any = None):
        self.start = start
        self.view = view
        self.finish = finish


def _as_1d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.ndim == 0 else t


def _plan(ckpt: CheckpointDir, target: ReadTarget, rank: int) -> list[tuple[str, _Piece]]:
    where = f"{ckpt.where}: key {target.key!r}"
    chunks = ckpt.chunks_for(target.key, rank)
    dest = target.dest
    if not chunks:
        raise CheckpointCorruptError(f"{where}: no chunk saved for rank {rank}")
    if chunks[0].global_shape != tuple(target.global_shape):
        raise CheckpointCorruptError(
            f"{where}: saved shape {list(chunks[0].global_shape)} differs from the state's "
            f"{list(target.global_shape)}")
    if chunks[0].dtype != dest.dtype:
        raise CheckpointCorruptError(f"{where}: saved dtype {chunks[0].dtype} differs from the state's {dest.dtype}")
    scalar = dest.ndim == 0
    dest = _as_1d(dest)
    t_off = (0,) if scalar else target.offset
    t_shape = tuple(dest.shape)
    pieces: list[tuple[str, _Piece]] = []
    covered = 0
    for c in chunks:
        c_off, c_shape = ((0,), (1,)) if scalar else (c.offset, c.shape)
        lo = [max(a, b) for a, b in zip(c_off, t_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(c_off, c_shape, t_off, t_shape)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        covered += math.prod(h - l for l, h in zip(lo, hi))
        entry = ckpt.header(c.file).entries.get(target.key)
        if entry is None or entry.dtype != c.dtype or entry.shape != tuple(c.shape):
            raise CheckpointCorruptError(f"{where}: {c.file} has no matching tensor entry")
        item = dest.element_size()
        row_bytes = math.prod(c_shape[1:]) * item
        r0, r1 = lo[0] - c_off[0], hi[0] - c_off[0]
        start = entry.start + r0 * row_bytes
        dest_box = dest[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, t_off))]
        whole_rows = all(l == o and h == o + n for l, h, o, n in zip(lo[1:], hi[1:], c_off[1:], c_shape[1:]))
        if whole_rows and dest_box.is_contiguous() and dest.device.type == "cpu":
            pieces.append((c.file, _Piece(start, tensor_bytes(dest_box))))
            continue
        tmp = torch.empty((r1 - r0) * row_bytes, dtype=torch.uint8)
        inner = (slice(None),) + tuple(slice(l - o, h - o) for l, h, o in zip(lo[1:], hi[1:], c_off[1:]))

        def finish(tmp=tmp, rows=r1 - r0, c_shape=c_shape, inner=inner, dest_box=dest_box) -> None:
            src = tmp.view(dest_box.dtype).reshape((rows, *c_shape[1:]))[inner]
            dest_box.copy_(src)
        pieces.append((c.file, _Piece(start, tensor_bytes(tmp), finish)))
    if covered != math.prod(t_shape):
        raise CheckpointCorruptError(
            f"{where}: the saved chunks cover {covered} of the {math.prod(t_shape)} elements this rank needs")
    return pieces


def _read_file(ckpt: CheckpointDir, file: str, pieces: list[_Piece]) -> None:
    path = Storage.join(ckpt.dir_path, file)
    record = ckpt.records.get(file) if ckpt.records is not None else None
    pieces.sort(key=lambda p: p.start)
    if not (ckpt.verify and record is not None):
        ckpt.storage.read_segments(path, [(p.start, p.view) for p in pieces])
        return
    # Read the whole file in order, unused bytes into scratch, hashing as it streams.
    segments: list[tuple[int, memoryview]] = []
    pos = 0

    def scratch(lo: int, hi: int) -> None:
        for s in range(lo, hi, SCRATCH_BYTES):
            segments.append((s, memoryview(bytearray(min(SCRATCH_BYTES, hi - s)))))
    for p in pieces:
        scratch(pos, p.start)
        segments.append((p.start, p.view))
        pos = p.start + len(p.view)
    scratch(pos, record.size)
    group: list[tuple[int, memoryview]] = []
    group_bytes = 0
    with Sha256Pipe() as digest:  # hashing one group overlaps reading the next
        for i, seg in enumerate(segments):
            group.append(seg)
            group_bytes += len(seg[1])
            if group_bytes >= GROUP_BYTES or i == len(segments) - 1:
                ckpt.storage.read_segments(path, group)
                for _, view in group:
                    digest.update(view)
                group, group_bytes = [], 0
        hexdigest = digest.hexdigest()
    ckpt._check_digest(file, hexdigest)


def read_targets(ckpt: CheckpointDir, targets: list[ReadTarget], rank: int) -> None:
    """Fill every target from the checkpoint (see the module docstring)."""
    by_file: dict[str, list[_Piece]] = defaultdict(list)
    staged_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for target in targets:
        if target.dest.device.type != "cpu":
            host = torch.empty(target.dest.shape, dtype=target.dest.dtype)
            staged_back.append((target.dest, host))
            target = ReadTarget(target.key, host, target.offset, target.global_shape)
        for file, piece in _plan(ckpt, target, rank):
            by_file[file].append(piece)
    for file in sorted(by_file):
        _read_file(ckpt, file, by_file[file])
        for piece in by_file[file]:
            if piece.finish is not None:
                piece.finish()
    for dest, host in staged_back:
        dest.copy_(host)
