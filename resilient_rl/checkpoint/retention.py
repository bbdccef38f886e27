"""Removing and setting aside a run's checkpoints: retention, clean-up, timelines set aside.

:class:`CheckpointRetention` adds to :class:`~resilient_rl.checkpoint.discovery.CheckpointDiscovery`
everything that takes checkpoints out of a run: committed steps moved aside to
``{run}/abandoned/{stamp}/`` when the run continues from an earlier step, what killed writers left
(uncommitted step folders, temp files, incomplete uploads), retention of the committed steps and
of the timelines set aside (the newest ``keep_last`` of them are kept, and every one set aside
since the run's newest commit). A step is un-committed (its manifest deleted) before the rest of
it, so a half-deleted step reads as uncommitted, never as valid; with a lease attached every
deletion checks that this writer still holds the run.
"""

from __future__ import annotations

import json
import calendar
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from resilient_rl.checkpoint.discovery import CheckpointDiscovery, commit_order
from resilient_rl.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME, parse_step_dirname, step_dirname
from resilient_rl.checkpoint.storage import TEMP_NAME_RE, Storage
from resilient_rl.errors import CheckpointError
from resilient_rl.log_route import FILE_ONLY

if TYPE_CHECKING:
    from resilient_rl.checkpoint.leases.run_lease import RunLease

log = logging.getLogger(__name__)

ABANDONED_DIR = "abandoned"
SET_ASIDE_NAME = "SET_ASIDE.json"

#: A timeline set aside: ``abandoned/{UTC time to the second}-{6 hex digits}/``.
_STAMP_RE = re.compile(r"^(\d{8}T\d{6}Z)-[0-9a-f]{6}$")
_STAMP_TIME = "%Y%m%dT%H%M%SZ"


def _stamp(at: float) -> str:
    return time.strftime(_STAMP_TIME, time.gmtime(at)) + "-" + uuid.uuid4().hex[:6]


def _set_aside_note(storage: Storage, root: str, stamp: str) -> tuple[int, float, list[int] | None]:
    """(fencing token, time, steps) of a timeline set aside, from its note: without a token
    0; without a time the end of the second its folder names (later rather than earlier: a
    timeline is never taken for older than it is; one whose name is no time is never taken
    for old); the steps None when the note does not name them."""
    data = storage.try_read_bytes(Storage.join(root, stamp, SET_ASIDE_NAME))
    try:
        note = json.loads(data) if data is not None else {}
    except ValueError:
        note = {}
    note = note if isinstance(note, dict) else {}
    token, at, steps = note.get("fencing_token"), note.get("at"), note.get("steps")
    token = token if isinstance(token, int) and not isinstance(token, bool) else 0
    if not (isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)):
        try:
            at = calendar.timegm(time.strptime(stamp.split("-", 1)[0], _STAMP_TIME)) + 1.0
        except ValueError:
            at = math.inf
    steps = steps if isinstance(steps, list) and all(isinstance(s, int) for s in steps) else None
    return token, float(at), steps


def _set_aside_whole(storage: Storage, root: str, stamp: str, steps: list[int] | None) -> bool:
    """Whether every step a timeline's note names was set aside whole in its folder (a
    manifest is copied or moved with its step, last)."""
    if steps is None:
        return True  # nothing to tell it by
    folder = Storage.join(root, stamp)
    return all(storage.exists(Storage.join(folder, step_dirname(s), MANIFEST_NAME)) for s in steps)


def _delete_set_aside(manager: "CheckpointRetention", folder: str) -> None:
    """Delete a timeline set aside, each step un-committed first."""
    steps = sorted(s for s in map(parse_step_dirname, manager.storage.ls(folder)) if s is not None)
    log.info("retention: deleting the timeline set aside in %s (step(s) %s)", manager.storage.url_for(folder),
             steps, extra=FILE_ONLY)
    manager._fence()
    for step in steps:  # un-commit first
        manager.storage.rm(Storage.join(folder, step_dirname(step), MANIFEST_NAME))
    manager.storage.rm(folder, recursive=True)


class CheckpointRetention(CheckpointDiscovery):
    """Set-aside, clean-up and retention of one run's checkpoints.

    The attributes below are set by :class:`~resilient_rl.checkpoint.manager.CheckpointManager`."""

    keep_last: int
    keep_every: int
    lease: RunLease | None

    def _fence(self) -> None:
        """Raise LeaseLostError when another writer took the run over (no-op without a lease)."""
        if self.lease is not None:
            self.lease.check()

    def _write_latest(self, step: int) -> None:
        self.storage.write_bytes_atomic(Storage.join(self.run_name, LATEST_NAME), step_dirname(step).encode(),
                                        before_publish=self._fence)

    def _delete_step(self, step: int) -> None:
        rel = self.step_rel(step)
        self._fence()  # a deletion after a slow write (retention follows a commit) checks again
        self.storage.rm(Storage.join(rel, MANIFEST_NAME))  # un-commit first
        self.storage.rm(rel, recursive=True)

    # ----------------------------------------------------------------- timelines set aside
    def set_aside_newer(self, step: int | None, reason: str, committed: list[int] | None = None) -> list[int]:
        """Move every committed step newer than ``step`` (every one, when None) out of the run
        into ``{run}/abandoned/{stamp}/``, with a ``SET_ASIDE.json`` saying why, and point
        ``latest`` at the newest step left. Nothing is deleted that is not copied first: locally
        a step folder moves in one rename; elsewhere it is copied, then un-committed (manifest
        first) and removed. ``committed``: the run's committed steps, when the caller has just
        listed them. Returns the steps moved."""
        committed = self.committed_steps() if committed is None else committed
        doomed = [s for s in committed if step is None or s > step]
        if not doomed:
            return []
        self._fence()
        now = time.time()
        dest = Storage.join(self.run_name, ABANDONED_DIR, _stamp(now))
        note = {"reason": reason, "steps": doomed, "at": now, "kept_up_to": step,
                "fencing_token": self.lease.token if self.lease is not None else None}
        self.storage.write_bytes_atomic(Storage.join(dest, SET_ASIDE_NAME), json.dumps(note, indent=1).encode())
        for s in doomed:
            src, dst = self.step_rel(s), Storage.join(dest, step_dirname(s))
            if self.storage.strategy == "local":
                self._fence()  # the rename takes committed steps out of the run: the last step before it
                self.storage.rename_local(src, dst)
            else:
                # The manifest last: a copy cut short reads as uncommitted, as a write cut short does.
                for path in sorted(self.storage.find(src), key=lambda path: path == MANIFEST_NAME):
                    self.storage.copy_file(Storage.join(src, path), Storage.join(dst, path))
                self._delete_step(s)
        remaining = [s for s in committed if s not in doomed]
        if remaining:
            self._write_latest(remaining[-1])
        else:
            self.storage.rm(Storage.join(self.run_name, LATEST_NAME))
        log.warning("set aside step(s) %s of run %s in %s: %s", doomed, self.run_url, self.storage.url_for(dest),
                    reason)
        return doomed

    def prune_set_aside(self, newest_commit: tuple[int, float] | None = None) -> list[str]:
        """Delete the timelines set aside under ``abandoned/`` but the newest ``keep_last``,
        except those set aside after the run's newest commit (``newest_commit``: the fencing token
        and time in its manifest; read from the newest committed step when None): the newest are
        what an operator would want back. Without a commit nothing is deleted. Each step of a
        timeline is un-committed before the rest of it is deleted. Returns the folders deleted,
        oldest first. Other entries of ``abandoned/`` (files of the run folder, when it shares the
        checkpoint root, or a file named like a timeline) are left alone.

        Timelines are ordered by the fencing token of the controller that set them aside, then
        by time (clocks of different hosts differ; tokens only grow). A set-aside cut short (its
        controller died between two steps' moves, and the next one moved the rest into a folder
        of its own) is one timeline with the next newer folder: they are kept or deleted together."""
        root = Storage.join(self.run_name, ABANDONED_DIR)
        stamps = [name for name in self.storage.ls(root, folders=True) if _STAMP_RE.match(name)]
        if len(stamps) <= self.keep_last:
            return []
        if newest_commit is None:
            committed = self.committed_steps()
            newest_commit = commit_order(self, committed[-1]) if committed else None
            if newest_commit is None:
                return []
        notes = {stamp: _set_aside_note(self.storage, root, stamp) for stamp in stamps}
        by_age = sorted(stamps, key=lambda stamp: (notes[stamp][0], notes[stamp][1], stamp))
        timelines: list[list[str]] = []
        for stamp in by_age:
            if timelines and not _set_aside_whole(self.storage, root, timelines[-1][-1], notes[timelines[-1][-1]][2]):
                timelines[-1].append(stamp)  # the rest of a set-aside cut short
            else:
                timelines.append([stamp])
        doomed = [stamp for timeline in timelines[:-self.keep_last] for stamp in timeline
                  if all(notes[s][:2] < newest_commit for s in timeline)]
        for stamp in doomed:
            _delete_set_aside(self, Storage.join(root, stamp))
        return doomed

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

        found = self.storage.find(self.run_name)
        doomed = [s for s, files in sorted(self.step_folders(found).items())
                  if MANIFEST_NAME not in files and s not in excluded]
        for step in doomed:
            log.info("deleting uncommitted checkpoint folder %s", self.step_dir(step))
            self.storage.rm(self.step_rel(step), recursive=True)
        gone = excluded | set(doomed)  # the temp files in these folders went with them
        for rel in found:
            match = TEMP_NAME_RE.search(rel)
            if match and int(match.group(1)) != os.getpid() and step_of(rel) not in gone:
                log.info("deleting temp file %s left by a killed writer", self.storage.url_for(
                    Storage.join(self.run_name, rel)))
                self.storage.rm(Storage.join(self.run_name, rel))
        for rel in self.storage.abort_incomplete_uploads(self.run_name, skip=lambda r: step_of(r) in excluded):
            log.info("aborted an incomplete multipart upload of %s", self.storage.url_for(
                Storage.join(self.run_name, rel)))
        return doomed

    # ----------------------------------------------------------------- retention
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

    def apply_retention(self, committed: list[int] | None = None) -> list[int]:
        """Keep the last ``keep_last`` committed steps, every step divisible by ``keep_every``,
        the one ``latest`` names and the newest known-good one (so checkpoints written after a
        NaN never push the last trustworthy state out); delete the other committed steps (all
        older than the newest committed one, so a step is only deleted once a newer one is
        committed). ``committed``: the run's committed steps, when the caller has just listed
        them."""
        committed = self.committed_steps() if committed is None else committed
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
