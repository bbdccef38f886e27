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
aside to ``abandoned/``, not deleted; a commit deletes the timelines set aside there but the newest
``keep_last`` and those set aside since the run's newest commit. With a lease attached
(:attr:`CheckpointManager.lease`), every commit and deletion checks that this writer still holds
the run, again right before each write is published (after its fsync, which can outlast a
takeover on network storage).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from resilient_rl.checkpoint.discovery import check_name
from resilient_rl.checkpoint.fanout import iter_ordered
from resilient_rl.checkpoint.manifest import (
    LATEST_NAME, MANIFEST_NAME, TRAINER_STATE_NAME, FileRecord, Manifest, shard_basename,
)
from resilient_rl.checkpoint.retention import ABANDONED_DIR, SET_ASIDE_NAME, CheckpointRetention
from resilient_rl.checkpoint.storage import RetryPolicy, Storage
from resilient_rl.checkpoint.verify import HASH_WORKERS, Verifier
from resilient_rl.errors import CheckpointCorruptError, CheckpointError, ConfigError, LeaseError

__all__ = ["ABANDONED_DIR", "SET_ASIDE_NAME", "CheckpointManager"]

log = logging.getLogger(__name__)


def _size_problem(manager: "CheckpointManager", step: int, present: Mapping[str, int], full: FileRecord,
                  rec: FileRecord) -> CheckpointError | None:
    """Why a commit refuses ``full`` by its listed size (missing, or not what the writer reported)."""
    if present.get(full.path) == rec.size:
        return None
    return CheckpointError(
        f"cannot commit step {step}: {manager.step_dir(step)}/{full.path} is "
        f"{'missing' if full.path not in present else f'{present[full.path]} bytes'}, "
        f"the writer reported {rec.size} bytes")


def _content_problem(manager: "CheckpointManager", step: int, present: Mapping[str, int], full: FileRecord,
                     rec: FileRecord) -> CheckpointError | None:
    """Why a commit refuses ``full`` by its content (a read of the whole file)."""
    if present.get(full.path) != rec.size:
        return None  # reported by its size check, which comes first
    if manager.verifier.sha256(Storage.join(manager.step_rel(step), full.path), rec.size) == rec.sha256:
        return None
    return CheckpointCorruptError(  # e.g. replaced by a writer of an abandoned save
        f"cannot commit step {step}: {manager.step_dir(step)}/{full.path} does not hold what its "
        "writer reported (sha256 differs)")


class CheckpointManager(CheckpointRetention):
    """Commits, finds, verifies and prunes the checkpoints of one run.

    Writing and the commit are here; finding and reading checkpoints are in
    :class:`~resilient_rl.checkpoint.discovery.CheckpointDiscovery`, taking them out of the run
    (retention, clean-up, setting aside) in :class:`~resilient_rl.checkpoint.retention.CheckpointRetention`."""

    def __init__(self, root: str, run_name: str, keep_last: int = 2, keep_every: int = 0,
                 storage_options: dict[str, Any] | None = None, retry: RetryPolicy = RetryPolicy(),
                 on_corrupt: Callable[[int, str], None] | None = None):
        if keep_last < 1:
            raise ConfigError(f"checkpoint keep_last must be >= 1, got {keep_last}")
        if keep_every < 0:
            raise ConfigError(f"checkpoint keep_every must be >= 0, got {keep_every}")
        self.run_name = check_name("run_name", run_name)
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
        then applies retention (to the committed steps, then to the timelines set aside)."""
        if set(files) != set(world_sizes):
            raise CheckpointError(f"commit of step {step}: roles with files {sorted(files)} differ "
                                  f"from roles with world sizes {sorted(world_sizes)}")
        rel = self.step_rel(step)
        present = self.storage.find(rel)
        records: list[FileRecord] = []
        # The checks in the order they are reported; the hashes (a read each) run side by side.
        checks: list[Callable[[], CheckpointError | None]] = []
        for role, role_files in sorted(files.items()):
            check_name("role", role)
            names = {r.path for r in role_files}
            checks += [lambda err=CheckpointError(f"cannot commit step {step}: role {role!r} rank {rank} "
                                                  f"reported no {shard_basename(rank)}{suffix}"): err
                       for rank in range(world_sizes[role]) for suffix in (".safetensors", ".json")
                       if shard_basename(rank) + suffix not in names]
            for rec in role_files:
                full = rec.with_prefix(role)
                checks.append(lambda full=full, rec=rec: _size_problem(self, step, present, full, rec))
                if verify_content:
                    checks.append(lambda full=full, rec=rec: _content_problem(self, step, present, full, rec))
                records.append(full)
        for problem in iter_ordered(lambda check: check(), checks, HASH_WORKERS):
            if problem is not None:
                raise problem
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
        entries = self.storage.ls(self.run_name)  # the one listing of the run a commit makes
        committed = self.committed_steps(entries)
        # Normally already done when the run was restored to an earlier step; kept, not deleted.
        moved = self.set_aside_newer(step, f"superseded by step {step}, committed after a restore to an earlier step",
                                     committed)
        self.apply_retention([s for s in committed if s not in moved])
        if ABANDONED_DIR in entries:
            try:  # housekeeping: the step is committed whatever it meets
                self.prune_set_aside((manifest.fencing_token or 0, manifest.created_at))
            except LeaseError:
                raise
            except (OSError, CheckpointError) as exc:
                log.warning("step %d is committed, but the timelines set aside in %s could not be pruned (again "
                            "at the next commit): %s", step, self.storage.url_for(Storage.join(self.run_name,
                                                                                              ABANDONED_DIR)), exc)
        return manifest
