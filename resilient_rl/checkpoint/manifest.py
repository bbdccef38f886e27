"""Checkpoint layout names, file records and the MANIFEST that commits a step.

A step folder ``{root}/{run}/step_{N:08d}/`` is *committed* once its ``MANIFEST.json`` exists.
The manifest lists every file of the step (path relative to the step folder, size, sha256), the
world size each role saved with, a digest of the config, and the fencing token of the lease its
writer held (``checkpoint/leases/run_lease.py``), so a loader can verify what it reads, a resumed run can notice
a changed config, and steps of a superseded writer can be told apart. ``known_good`` says that no NaN
or Inf was seen in the run since the previous known-good checkpoint (a checkpoint whose tensors are
not finite is never committed at all); retention always keeps the newest known-good one. Everything here is plain JSON: reading a
checkpoint never unpickles anything.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from resilient_rl.errors import CheckpointCorruptError, CheckpointFormatError

FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "latest"
TRAINER_STATE_NAME = "trainer_state.json"

_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")


def step_dirname(step: int) -> str:
    """Folder name of ``step`` (``step_00000042``); zero-padded so names sort by step."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step encoded in a folder name, or None when ``name`` is not a step folder."""
    match = _STEP_DIR_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def shard_basename(rank: int) -> str:
    """Stem of a rank's shard files: ``shard_00003`` (+ ``.safetensors`` / ``.json``)."""
    return f"shard_{rank:05d}"


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: path relative to its folder, size in bytes and sha256 (hex)."""

    path: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest") -> "FileRecord":
        try:
            path, size, sha = obj["path"], obj["size"], obj["sha256"]
        except (TypeError, KeyError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed file record {obj!r}") from exc
        if (not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/")
                or isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(sha, str)):
            raise CheckpointCorruptError(f"{where}: malformed file record {str(obj)[:200]}")
        return cls(path, size, sha)

    def with_prefix(self, prefix: str) -> "FileRecord":
        """The same record with ``prefix/`` prepended to its path (role folder -> step folder)."""
        return FileRecord(f"{prefix.strip('/')}/{self.path}" if prefix else self.path,
                          self.size, self.sha256)


@dataclass(frozen=True)
class Manifest:
    """Content of ``MANIFEST.json``: what a committed step consists of."""

    step: int
    files: tuple[FileRecord, ...]
    world_sizes: dict[str, int]
    config_digest: str = ""
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    fencing_token: int | None = None  # None: written without a lease (older runs, tools)
    known_good: bool = True

    def files_under(self, prefix: str) -> list[FileRecord]:
        """Records of the files in sub-folder ``prefix`` (e.g. a role), relative to it."""
        head = prefix.strip("/") + "/"
        return [FileRecord(r.path[len(head):], r.size, r.sha256)
                for r in self.files if r.path.startswith(head)]

    def to_bytes(self) -> bytes:
        obj = {
            "format_version": self.format_version,
            "step": self.step,
            "created_at": self.created_at,
            "world_sizes": dict(self.world_sizes),
            "config_digest": self.config_digest,
            "known_good": self.known_good,
            "files": [r.to_json() for r in self.files],
        }
        if self.fencing_token is not None:
            obj["fencing_token"] = self.fencing_token
        return json.dumps(obj, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        """Parse a manifest; any defect is a CheckpointCorruptError naming ``where``."""
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointCorruptError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise CheckpointCorruptError(f"{where}: expected a JSON object")
        version = obj.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{where}: written by a newer resilient-rl (format_version {version}; this version reads "
                f"format_version {FORMAT_VERSION}). Upgrade resilient-rl (pip install -U resilient-rl) on this "
                "controller and its workers to resume it; nothing was changed")
        if version != FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{where}: unsupported format_version {version!r} (this build reads {FORMAT_VERSION})")
        try:
            step = obj["step"]
            world_sizes = obj["world_sizes"]
            if not isinstance(obj["files"], list):
                raise TypeError("files is not a list")
            files = tuple(FileRecord.from_json(r, where) for r in obj["files"])
            created_at = float(obj["created_at"])
            digest = obj.get("config_digest", "")
            token = obj.get("fencing_token")
            known_good = obj.get("known_good", True)  # manifests written before the flag existed
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointCorruptError(f"{where}: missing or malformed field ({exc!r})") from exc
        if not math.isfinite(created_at):
            raise CheckpointCorruptError(f"{where}: created_at {created_at} is not a time")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(world_sizes, dict) \
                or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                           for k, v in world_sizes.items()):
            raise CheckpointCorruptError(f"{where}: malformed step or world_sizes")
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            raise CheckpointCorruptError(f"{where}: malformed fencing_token {token!r}")
        if not isinstance(known_good, bool):
            raise CheckpointCorruptError(f"{where}: known_good must be true or false, got {known_good!r}")
        return cls(step=step, files=files, world_sizes=world_sizes, config_digest=str(digest),
                   created_at=created_at, format_version=version, fencing_token=token, known_good=known_good)
