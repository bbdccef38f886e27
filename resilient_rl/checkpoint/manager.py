"""Controller side of checkpoints: commit protocol, discovery, verification and retention.

Layout under ``root`` (any fsspec URL)::

    {run}/step_{N:08d}/{role}/shard_{rank:05d}.safetensors | .json   written by the workers
    {run}/step_{N:08d}/trainer_state.json                            written by the controller
    {run}/step_{N:08d}/MANIFEST.json                                 written last: the commit
    {run}/latest                                                     "step_{N:08d}", after it

A step without a manifest is not committed: it is never loaded and is cleaned up later. The
``latest`` pointer is written atomically after the manifest; a committed step newer than it
(a crash between the two writes) is still found. Old steps are deleted only after a newer one
is committed, manifest first, so a half-deleted step reads as uncommitted, never as valid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from resilient_rl.checkpoint.hashing import Sha256Pipe
from resilient_rl.checkpoint.manifest import (
    LATEST_NAME, MANIFEST_NAME, TRAINER_STATE_NAME, FileRecord, Manifest, parse_step_dirname,
    shard_basename, step_dirname,
)
from resilient_rl.checkpoint.storage import RetryPolicy, Storage
from resilient_rl.errors import (
    CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError,
)

log = logging.getLogger(__name__)

_HASH_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class CheckpointInfo:
    """One step folder: committed or not, total size, age (committed only) and shallow status."""

    step: int
    committed: bool
    size_bytes: int
    age_s: float | None
    status: str


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"checkpoint {kind} must be a non-empty name without '/', got {name!r}")
    return name


class CheckpointManager:
    """Commits, finds, verifies and prunes the checkpoints of one run."""

    def __init__(self, root: str, run_name: str, keep_last: int = 2, keep_every: int = 0,
                 storage_options: dict[str, Any] | None = None, retry: RetryPolicy = RetryPolicy(),
                 on_corrupt: Callable[[int, str], None] | None = None):
        if keep_last < 1:
            raise ConfigError(f"checkpoint keep_last must be >= 1, got {keep_last}")
        if keep_every < 0:
            raise ConfigError(f"checkpoint keep_every must be >= 0, got {keep_every}")
        self.run_name = _check_name("run_name", run_name)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_corrupt = on_corrupt
        self.storage = Storage(root, storage_options, retry)
        self.storage_options = dict(storage_options or {})

    def __repr__(self) -> str:
        return f"CheckpointManager({self.run_url!r})"

    # ----------------------------------------------------------------- paths
    @property
    def run_url(self) -> str:
        return self.storage.url_for(self.run_name)

    def _step_rel(self, step: int) -> str:
        return Storage.join(self.run_name, step_dirname(step))

    def step_dir(self, step: int) -> str:
        """URL of the step folder (open it with this manager's storage options)."""
        return self.storage.url_for(self._step_rel(step))

    def role_dir(self, step: int, role: str) -> str:
        """URL of a role's folder in a step: where its workers write their shards."""
        return self.storage.url_for(Storage.join(self._step_rel(step), _check_name("role", role)))

    # ----------------------------------------------------------------- writing
    def write_trainer_state(self, step: int, state: Mapping[str, Any]) -> FileRecord:
        """Write the controller's state for ``step`` as JSON (tuples become lists)."""
        try:
            data = json.dumps(state, indent=1, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"trainer state of step {step} is not JSON-serialisable: {exc}") from exc
        return self.storage.write_bytes_atomic(Storage.join(self._step_rel(step), TRAINER_STATE_NAME), data)

    def begin_step(self, step: int) -> None:
        """Clear leftovers of an earlier attempt at ``step`` so its save starts from an empty
        folder. A committed ``step`` (from a timeline abandoned by a restore to an earlier step)
        is un-committed first, and ``latest`` moved off it."""
        rel = self._step_rel(step)
        if self.is_committed(step):
            log.warning("re-saving step %d: un-committing its earlier checkpoint %s", step, self.step_dir(step))
            self.storage.rm(Storage.join(rel, MANIFEST_NAME))
            if self._pointer() == step:
                remaining = self.committed_steps()
                if remaining:
                    self._write_latest(remaining[-1])
                else:
                    self.storage.rm(Storage.join(self.run_name, LATEST_NAME))
        self.storage.rm(rel, recursive=True)

    def commit(self, step: int, files: Mapping[str, list[FileRecord]], world_sizes: Mapping[str, int],
               config_digest: str = "", known_good: bool = True) -> Manifest:
        """Commit ``step`` once every rank of every role has written its shards.

        ``files`` maps each role to its ranks' records (paths relative to the role folder, as
        :func:`write_shard` returns them). Checks that every rank's files exist with the
        recorded sizes, writes the manifest, then ``latest``, then applies retention."""
        if set(files) != set(world_sizes):
            raise CheckpointError(f"commit of step {step}: roles with files {sorted(files)} differ "
                                  f"from roles with world sizes {sorted(world_sizes)}")
        rel = self._step_rel(step)
        present = self.storage.find(rel)
        records: list[FileRecord] = []
        for role, role_files in sorted(files.items()):
            _check_name("role", role)
            names = {r.path for r in role_files}
            for rank in range(world_sizes[role]):
                for suffix in (".safetensors", ".json"):
                    if shard_basename(rank) + suffix not in names:
                        raise CheckpointError(f"cannot commit step {step}: role {role!r} rank {rank} "
                                              f"reported no {shard_basename(rank)}{suffix}")
            for rec in role_files:
                full = rec.with_prefix(role)
                if present.get(full.path) != rec.size:
                    raise CheckpointError(
                        f"cannot commit step {step}: {self.step_dir(step)}/{full.path} is "
                        f"{'missing' if full.path not in present else f'{present[full.path]} bytes'}, "
                        f"the writer reported {rec.size} bytes")
                records.append(full)
        if TRAINER_STATE_NAME in present:
            data = self.storage.read_bytes(Storage.join(rel, TRAINER_STATE_NAME))
            records.append(FileRecord(TRAINER_STATE_NAME, len(data), hashlib.sha256(data).hexdigest()))
        manifest = Manifest(step=step, files=tuple(sorted(records, key=lambda r: r.path)),
                            world_sizes=dict(world_sizes), config_digest=config_digest, known_good=known_good)
        self.storage.write_bytes_atomic(Storage.join(rel, MANIFEST_NAME), manifest.to_bytes())
        self._write_latest(step)
        for newer in [s for s in self.committed_steps() if s > step]:
            log.warning("deleting step %d: superseded by step %d after a restore to an earlier step", newer, step)
            self._delete_step(newer)
        self.apply_retention()
        return manifest

    def _write_latest(self, step: int) -> None:
        self.storage.write_bytes_atomic(Storage.join(self.run_name, LATEST_NAME), step_dirname(step).encode())

    def _delete_step(self, step: int) -> None:
        rel = self._step_rel(step)
        self.storage.rm(Storage.join(rel, MANIFEST_NAME))  # un-commit first
        self.storage.rm(rel, recursive=True)

    # ----------------------------------------------------------------- discovery
    def _steps(self) -> dict[int, dict[str, int]]:
        """{step: {path in the step folder: size}} for every step folder of the run."""
        out: dict[int, dict[str, int]] = defaultdict(dict)
        for path, size in self.storage.find(self.run_name).items():
            head, _, rest = path.partition("/")
            step = parse_step_dirname(head)
            if step is not None and rest:
                out[step][rest] = size
        for name in self.storage.ls(self.run_name):
            step = parse_step_dirname(name)
            if step is not None:
                out.setdefault(step, {})
        return dict(out)

    def committed_steps(self) -> list[int]:
        return sorted(s for s, files in self._steps().items() if MANIFEST_NAME in files)

    def is_committed(self, step: int) -> bool:
        return self.storage.exists(Storage.join(self._step_rel(step), MANIFEST_NAME))

    def _pointer(self) -> int | None:
        data = self.storage.try_read_bytes(Storage.join(self.run_name, LATEST_NAME))
        if data is None:
            return None
        return parse_step_dirname(data.decode(errors="replace").strip())

    def latest_step(self) -> int | None:
        """The newest committed step (the one ``latest`` names, unless the process died between
        writing a manifest and the pointer), or None."""
        committed = self.committed_steps()
        return committed[-1] if committed else None

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every step folder, oldest first, with a shallow (sizes only) status."""
        now = time.time()
        infos = []
        for step, files in sorted(self._steps().items()):
            size = sum(files.values())
            if MANIFEST_NAME not in files:
                infos.append(CheckpointInfo(step, False, size, None, "uncommitted"))
                continue
            try:
                manifest = self.load_manifest(step)
            except CheckpointCorruptError as exc:
                infos.append(CheckpointInfo(step, True, size, None, f"corrupt: {MANIFEST_NAME}: {exc}"))
                continue
            status = self._check(step, manifest, files, deep=False)
            infos.append(CheckpointInfo(step, True, size, max(0.0, now - manifest.created_at), status))
        return infos

    def load_manifest(self, step: int) -> Manifest:
        where = f"{self.step_dir(step)}/{MANIFEST_NAME}"
        data = self.storage.try_read_bytes(Storage.join(self._step_rel(step), MANIFEST_NAME))
        if data is None:
            raise CheckpointNotFoundError(f"{where} does not exist: step {step} is not committed")
        manifest = Manifest.from_bytes(data, where)
        if manifest.step != step:
            raise CheckpointCorruptError(f"{where}: describes step {manifest.step}, not {step}")
        return manifest

    def role_files(self, step: int, role: str) -> list[FileRecord]:
        """The manifest's records of a role's files, relative to :meth:`role_dir`."""
        return self.load_manifest(step).files_under(role)

    def load_trainer_state(self, step: int) -> dict[str, Any]:
        """The controller state saved with ``step``, checked against the manifest."""
        manifest = self.load_manifest(step)
        rec = next((r for r in manifest.files if r.path == TRAINER_STATE_NAME), None)
        where = f"{self.step_dir(step)}/{TRAINER_STATE_NAME}"
        if rec is None:
            raise CheckpointNotFoundError(f"step {step} was committed without a {TRAINER_STATE_NAME}")
        data = self.storage.try_read_bytes(Storage.join(self._step_rel(step), TRAINER_STATE_NAME))
        if data is None:
            raise CheckpointCorruptError(f"{where}: file is missing")
        if len(data) != rec.size or hashlib.sha256(data).hexdigest() != rec.sha256:
            raise CheckpointCorruptError(f"{where}: size or sha256 differs from the manifest")
        try:
            state = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(state, dict):
            raise CheckpointCorruptError(f"{where}: expected a JSON object")
        return state

    # ----------------------------------------------------------------- verification
    def _sha256(self, path: str, size: int) -> str:
        with Sha256Pipe() as digest:  # hashing a chunk overlaps reading the next
            for start in range(0, size, _HASH_CHUNK):
                digest.update(memoryview(self.storage.read_bytes(path, start, min(size, start + _HASH_CHUNK))))
            return digest.hexdigest()

    def _check(self, step: int, manifest: Manifest, present: Mapping[str, int], deep: bool) -> str:
        for rec in manifest.files:
            if rec.path not in present:
                return f"corrupt: {rec.path}: missing"
            if present[rec.path] != rec.size:
                return f"corrupt: {rec.path}: size {present[rec.path]} != {rec.size} in the manifest"
        if deep:
            rel = self._step_rel(step)
            for rec in manifest.files:
                if self._sha256(Storage.join(rel, rec.path), rec.size) != rec.sha256:
                    return f"corrupt: {rec.path}: sha256 mismatch"
        return "ok"

    def verify(self, step: int, deep: bool = True) -> str:
        """``"ok"``, ``"corrupt: <file>: <why>"`` or ``"uncommitted"``. Sizes are always
        checked; with ``deep`` every file is read and its sha256 compared."""
        present = self.storage.find(self._step_rel(step))
        if MANIFEST_NAME not in present:
            return "uncommitted"
        try:
            manifest = self.load_manifest(step)
        except CheckpointCorruptError as exc:
            return f"corrupt: {MANIFEST_NAME}: {exc}"
        return self._check(step, manifest, present, deep)

    def find_latest_valid(self, deep: bool = True) -> int | None:
        """The newest committed step that verifies; each corrupt one on the way is reported
        through ``on_corrupt(step, reason)`` and logged. None when there is none."""
        for step in reversed(self.committed_steps()):
            status = self.verify(step, deep=deep)
            if status == "ok":
                return step
            if status.startswith("corrupt"):
                log.error("checkpoint %s is %s; falling back to an earlier one", self.step_dir(step), status)
                if self.on_corrupt is not None:
                    self.on_corrupt(step, status)
        return None

    # ----------------------------------------------------------------- cleanup
    def cleanup_uncommitted(self, exclude_step: int | None = None) -> list[int]:
        """Delete step folders without a manifest (except ``exclude_step``, being written)."""
        doomed = [s for s, files in sorted(self._steps().items())
                  if MANIFEST_NAME not in files and s != exclude_step]
        for step in doomed:
            log.info("deleting uncommitted checkpoint folder %s", self.step_dir(step))
            self.storage.rm(self._step_rel(step), recursive=True)
        return doomed

    def newest_known_good(self, committed: list[int] | None = None) -> int | None:
        """The newest committed step whose manifest says ``known_good`` (an unreadable manifest
        does not count), or None."""
        for step in reversed(self.committed_steps() if committed is None else committed):
            try:
                if self.load_manifest(step).known_good:
                    return step
            except CheckpointError:
                continue
        return None

    def apply_retention(self) -> list[int]:
        """Keep the last ``keep_last`` committed steps, every step divisible by ``keep_every``,
        the one ``latest`` names and the newest known-good one (so checkpoints written after a
        NaN never push the last trustworthy state out); delete the other committed steps (all
        older than the newest committed one, so a step is only deleted once a newer one is
        committed)."""
        committed = self.committed_steps()
        if not committed:
            return []
        latest = committed[-1]
        keep = set(committed[-self.keep_last:]) | {self._pointer(), self.newest_known_good(committed)}
        if self.keep_every:
            keep |= {s for s in committed if s % self.keep_every == 0}
        doomed = [s for s in committed if s not in keep and s < latest]
        for step in doomed:
            log.info("retention: deleting checkpoint %s", self.step_dir(step))
            self._delete_step(step)
        return doomed
