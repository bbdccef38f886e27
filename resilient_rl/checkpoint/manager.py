"""Controller side of checkpoints: commit protocol, discovery, verification and retention.

Layout under ``root`` (any fsspec URL)::

    {run}/step_{N:08d}/{role}/shard_{rank:05d}.safetensors | .json   written by the workers
    {run}/step_{N:08d}/trainer_state.json                            written by the controller
    {run}/step_{N:08d}/MANIFEST.json                                 written last: the commit
    {run}/latest                                                     "step_{N:08d}", after it
    {run}/lease/token_{T:08d}.json                                   the writer's lease (lease.py)
    {run}/abandoned/{stamp}/step_{N:08d}/...                         steps of a timeline set aside

A step without a manifest is not committed: it is never loaded and is cleaned up later. The
``latest`` pointer is written atomically after the manifest; a committed step newer than it
(a crash between the two writes) is still found, but one that was committed *before* the step
``latest`` names (by a superseded writer or an abandoned timeline) is not. Old steps are deleted
only after a newer one is committed, manifest first, so a half-deleted step reads as uncommitted,
never as valid. When a run continues from an earlier step, the newer committed steps are moved
aside to ``abandoned/``, not deleted. With a lease attached (:attr:`CheckpointManager.lease`),
every commit and deletion checks that this writer still holds the run, again right before each
write is published (after its fsync, which can outlast a takeover on network storage).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from resilient_rl.checkpoint.manifest import (
    LATEST_NAME, MANIFEST_NAME, TRAINER_STATE_NAME, FileRecord, Manifest, parse_step_dirname,
    shard_basename, step_dirname,
)
from resilient_rl.checkpoint.verify import Verifier
from resilient_rl.checkpoint.storage import TEMP_NAME_RE, RetryPolicy, Storage
from resilient_rl.log_route import FILE_ONLY
from resilient_rl.errors import (
    CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError,
)

log = logging.getLogger(__name__)

ABANDONED_DIR = "abandoned"
SET_ASIDE_NAME = "SET_ASIDE.json"


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
        #: The writer's :class:`~resilient_rl.checkpoint.leases.run_lease.RunLease`, checked before every
        #: commit and deletion; None for readers and tools that do not write a live run.
        self.lease = None
        self.verifier = Verifier(self.storage)  # deep verifications are remembered by manifest hash

    def __repr__(self) -> str:
        return f"CheckpointManager({self.run_url!r})"

    # ----------------------------------------------------------------- paths
    @property
    def run_url(self) -> str:
        return self.storage.url_for(self.run_name)

    def same_run(self, other: "CheckpointManager") -> bool:
        """Whether ``other`` manages this run's folder, however either spells its root."""
        return other.storage.location(other.run_name) == self.storage.location(self.run_name)

    def step_rel(self, step: int) -> str:
        """The folder of ``step``, relative to the storage root."""
        return Storage.join(self.run_name, step_dirname(step))

    def step_dir(self, step: int) -> str:
        """URL of the step folder (open it with this manager's storage options)."""
        return self.storage.url_for(self.step_rel(step))

    def role_dir(self, step: int, role: str) -> str:
        """URL of a role's folder in a step: where its workers write their shards."""
        return self.storage.url_for(Storage.join(self.step_rel(step), _check_name("role", role)))

    def _fence(self) -> None:
        """Raise LeaseLostError when another writer took the run over (no-op without a lease)."""
        if self.lease is not None:
            self.lease.check()

    # ----------------------------------------------------------------- writing
    def write_trainer_state(self, step: int, state: Mapping[str, Any]) -> FileRecord:
        """Write the controller's state for ``step`` as JSON (tuples become lists)."""
        try:
            data = json.dumps(state, indent=1, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"trainer state of step {step} is not JSON-serialisable: {exc}") from exc
        return self.storage.write_bytes_atomic(Storage.join(self.step_rel(step), TRAINER_STATE_NAME), data)

    def begin_step(self, step: int) -> None:
        """Clear leftovers of an earlier attempt at ``step`` so its save starts from an empty
        folder. A committed ``step`` (from a timeline abandoned by a restore to an earlier step)
        is un-committed first, and ``latest`` moved off it."""
        self._fence()
        rel = self.step_rel(step)
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
               config_digest: str = "", known_good: bool = True, verify_content: bool = True) -> Manifest:
        """Commit ``step`` once every rank of every role has written its shards.

        ``files`` maps each role to its ranks' records (paths relative to the role folder, as
        :func:`write_shard` returns them). Checks that every rank's files exist with the
        recorded sizes and (``verify_content``) hashes, writes the manifest, then ``latest``,
        then applies retention."""
        if set(files) != set(world_sizes):
            raise CheckpointError(f"commit of step {step}: roles with files {sorted(files)} differ "
                                  f"from roles with world sizes {sorted(world_sizes)}")
        rel = self.step_rel(step)
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
                if verify_content and self.verifier.sha256(Storage.join(rel, full.path), rec.size) != rec.sha256:
                    raise CheckpointCorruptError(  # e.g. replaced by a writer of an abandoned save
                        f"cannot commit step {step}: {self.step_dir(step)}/{full.path} does not hold what its "
                        "writer reported (sha256 differs)")
                records.append(full)
        if TRAINER_STATE_NAME in present:
            data = self.storage.read_bytes(Storage.join(rel, TRAINER_STATE_NAME))
            records.append(FileRecord(TRAINER_STATE_NAME, len(data), hashlib.sha256(data).hexdigest()))
        self._fence()  # early: a lost lease stops before the manifest is written (again before it is published)
        manifest = Manifest(step=step, files=tuple(sorted(records, key=lambda r: r.path)),
                            world_sizes=dict(world_sizes), config_digest=config_digest, known_good=known_good,
                            fencing_token=self.lease.token if self.lease is not None else None)
        self.storage.write_bytes_atomic(Storage.join(rel, MANIFEST_NAME), manifest.to_bytes(),
                                        before_publish=self._fence)
        self._write_latest(step)
        # Normally already done when the run was restored to an earlier step; kept, not deleted.
        self.set_aside_newer(step, f"superseded by step {step}, committed after a restore to an earlier step")
        self.apply_retention()
        return manifest

    def _write_latest(self, step: int) -> None:
        self.storage.write_bytes_atomic(Storage.join(self.run_name, LATEST_NAME), step_dirname(step).encode(),
                                        before_publish=self._fence)

    def _delete_step(self, step: int) -> None:
        rel = self.step_rel(step)
        self._fence()  # a deletion after a slow write (retention follows a commit) checks again
        self.storage.rm(Storage.join(rel, MANIFEST_NAME))  # un-commit first
        self.storage.rm(rel, recursive=True)

    # ----------------------------------------------------------------- discovery
    def step_folders(self) -> dict[int, dict[str, int]]:
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
        return sorted(s for s, files in self.step_folders().items() if MANIFEST_NAME in files)

    def is_committed(self, step: int) -> bool:
        return self.storage.exists(Storage.join(self.step_rel(step), MANIFEST_NAME))

    def _pointer(self) -> int | None:
        data = self.storage.try_read_bytes(Storage.join(self.run_name, LATEST_NAME))
        if data is None:
            return None
        return parse_step_dirname(data.decode(errors="replace").strip())

    def _commit_order(self, step: int) -> tuple[int, float] | None:
        """(fencing token, commit time) of a committed step; None when its manifest is unreadable."""
        try:
            m = self.load_manifest(step)
        except CheckpointError:
            return None
        return (m.fencing_token or 0, m.created_at)

    def timeline_steps(self) -> list[int]:
        """The committed steps of the run's current timeline, oldest first: every committed step
        up to the one ``latest`` names, and a newer one only if it was committed after that one
        (the writer died between a manifest and the pointer), judged by fencing token, then
        commit time. Without a valid pointer, every committed step."""
        committed = self.committed_steps()
        pointer = self._pointer()
        if pointer not in committed or committed[-1] == pointer:
            return committed
        base = self._commit_order(pointer)
        if base is None:
            return committed
        keep = []
        for s in committed:
            order = self._commit_order(s) if s > pointer else None
            if s <= pointer or order is None or order >= base:
                keep.append(s)  # an unreadable newer manifest is kept: verification reports it
            else:
                log.warning("ignoring committed step %d: it was committed before step %d, which `%s` names "
                            "(a superseded writer or an abandoned timeline)", s, pointer, LATEST_NAME)
        return keep

    def latest_step(self) -> int | None:
        """The newest step of the current timeline (the one ``latest`` names, unless the process
        died between writing a manifest and the pointer), or None."""
        timeline = self.timeline_steps()
        return timeline[-1] if timeline else None

    def newest_fencing_token(self) -> int:
        """The highest fencing token among the newest committed manifests (0 if none): a floor
        for a new lease, so tokens keep growing even if the lease folder was removed."""
        tokens = [(self._commit_order(s) or (0, 0.0))[0] for s in self.committed_steps()[-3:]]
        return max(tokens, default=0)

    def set_aside_newer(self, step: int | None, reason: str) -> list[int]:
        """Move every committed step newer than ``step`` (every one, when None) out of the run
        into ``{run}/abandoned/{stamp}/``, with a ``SET_ASIDE.json`` saying why, and point
        ``latest`` at the newest step left. Nothing is deleted that is not copied first: locally
        a step folder moves in one rename; elsewhere it is copied, then un-committed (manifest
        first) and removed. Returns the steps moved."""
        doomed = [s for s in self.committed_steps() if step is None or s > step]
        if not doomed:
            return []
        self._fence()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
        dest = Storage.join(self.run_name, ABANDONED_DIR, stamp)
        note = {"reason": reason, "steps": doomed, "at": time.time(), "kept_up_to": step,
                "fencing_token": self.lease.token if self.lease is not None else None}
        self.storage.write_bytes_atomic(Storage.join(dest, SET_ASIDE_NAME), json.dumps(note, indent=1).encode())
        for s in doomed:
            src, dst = self.step_rel(s), Storage.join(dest, step_dirname(s))
            if self.storage.strategy == "local":
                self._fence()  # the rename takes committed steps out of the run: the last step before it
                self.storage.rename_local(src, dst)
            else:
                for path in self.storage.find(src):
                    self.storage.copy_file(Storage.join(src, path), Storage.join(dst, path))
                self._delete_step(s)
        remaining = self.committed_steps()
        if remaining:
            self._write_latest(remaining[-1])
        else:
            self.storage.rm(Storage.join(self.run_name, LATEST_NAME))
        log.warning("set aside step(s) %s of run %s in %s: %s", doomed, self.run_url, self.storage.url_for(dest),
                    reason)
        return doomed

    def load_manifest(self, step: int) -> Manifest:
        where = f"{self.step_dir(step)}/{MANIFEST_NAME}"
        data = self.storage.try_read_bytes(Storage.join(self.step_rel(step), MANIFEST_NAME))
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
        data = self.storage.try_read_bytes(Storage.join(self.step_rel(step), TRAINER_STATE_NAME))
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
    def verify(self, step: int, deep: bool = True) -> str:
        """``"ok"``, ``"corrupt: <file>: <why>"`` or ``"uncommitted"``. Sizes are always
        checked; with ``deep`` every file is read and its sha256 compared."""
        present = self.storage.find(self.step_rel(step))
        if MANIFEST_NAME not in present:
            return "uncommitted"
        try:
            manifest = self.load_manifest(step)
        except CheckpointCorruptError as exc:
            return f"corrupt: {MANIFEST_NAME}: {exc}"
        return self.verifier.check(self.step_rel(step), manifest, present, deep)

    def find_latest_valid(self, deep: bool = True) -> int | None:
        """The newest committed step that verifies; each corrupt one on the way is reported
        through ``on_corrupt(step, reason)`` and logged. None when there is none."""
        for step in reversed(self.timeline_steps()):
            status = self.verify(step, deep=deep)
            if status == "ok":
                return step
            if status.startswith("corrupt"):
                log.error("checkpoint %s is %s; falling back to an earlier one", self.step_dir(step), status)
                if self.on_corrupt is not None:
                    self.on_corrupt(step, status)
        return None

    # ----------------------------------------------------------------- cleanup
    def cleanup_uncommitted(self, exclude_step: int | Iterable[int] | None = None) -> list[int]:
        """Remove what killed writers left in the run: step folders without a manifest, temp
        files of atomic writes that never got renamed, and (S3) incomplete multipart uploads.

        ``exclude_step`` (one step or several) names saves that may still be in flight: their
        folders, temp files and uploads are left alone, as are temp files of this process
        (a writer thread of it may be between write and rename). Returns the deleted steps."""
        self._fence()  # they may be another writer's steps in flight
        excluded = {exclude_step} if isinstance(exclude_step, int) else set(exclude_step or ())

        def step_of(rel: str) -> int | None:
            return parse_step_dirname(rel.split("/", 1)[0]) if "/" in rel else None

        doomed = [s for s, files in sorted(self.step_folders().items())
                  if MANIFEST_NAME not in files and s not in excluded]
        for step in doomed:
            log.info("deleting uncommitted checkpoint folder %s", self.step_dir(step))
            self.storage.rm(self.step_rel(step), recursive=True)
        gone = excluded | set(doomed)
        for rel in self.storage.find(self.run_name):
            match = TEMP_NAME_RE.search(rel)
            if match and int(match.group(1)) != os.getpid() and step_of(rel) not in gone:
                log.info("deleting temp file %s left by a killed writer", self.storage.url_for(
                    Storage.join(self.run_name, rel)))
                self.storage.rm(Storage.join(self.run_name, rel))
        for rel in self.storage.abort_incomplete_uploads(self.run_name, skip=lambda r: step_of(r) in excluded):
            log.info("aborted an incomplete multipart upload of %s", self.storage.url_for(
                Storage.join(self.run_name, rel)))
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
            log.info("retention: deleting checkpoint %s", self.step_dir(step), extra=FILE_ONLY)
            self._delete_step(step)
        return doomed
