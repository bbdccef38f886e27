"""Controller side of checkpoints: when to save, and the commit once every rank has written.

The controller writes ``trainer_state.json`` (its state: ``step``, the data ``loader`` position,
``kl_ctrl``, ``failure_budget``, ``nonfinite`` and ``config_digest``), asks every rank of the trainable roles to
stage and write its shards, and commits the step (manifest, then ``latest``) only after every rank
has reported its files. At most one save is in flight. Checkpoint I/O failures do not end the run: a save whose rank lost its writer
(the process restarted) is abandoned and the run recovers; a due save finding the previous one
still writing after ``checkpoint.save_timeout_s`` is skipped; a storage outage (transient errors
past the retries) skips the checkpoint while training goes on, until more than
``checkpoint.max_skipped`` were skipped in a row (CheckpointsSkippedError; the last committed
checkpoint stays intact). A permanent storage error (no space left) still stops the run.
Restoring is :mod:`~resilient_rl.checkpoint.restore`.

One writer per run: before writing, the controller takes the run's lease (``acquire_lease``,
``checkpoint/leases/run_lease.py``); every commit and deletion checks it, and its fencing token goes into
each manifest. A step whose state holds a NaN or Inf (a worker's shard, or the controller's own
state) is never committed: the save is refused with a ``checkpoint_refused`` event.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from resilient_rl.checkpoint import CheckpointManager, FileRecord
from resilient_rl.checkpoint.leases.run_lease import Lease, RunLease
from resilient_rl.checkpoint.retry import is_outage
from resilient_rl.errors import (CheckpointCorruptError, CheckpointError, CheckpointsSkippedError, ConfigError,
                                 LeaseLostError, RRLError, StorageError, WorkerDiedError)
from resilient_rl.checkpoint.restore import Restorer, rel_for

logger = logging.getLogger(__name__)


class CheckpointCoordinator:
    """Saves, commits and restores the checkpoints of one run."""

    def __init__(self, cfg, on_event: Callable[..., None] | None = None, metrics=None):
        c = cfg.checkpoint
        self.cfg = cfg
        self.root = c.root
        self.run_name = cfg.trainer.run_name
        self.save_every = c.save_every
        self.async_save = c.async_save
        self.on_event = on_event or (lambda *a, **k: None)
        self.metrics = metrics
        self.storage_options = dict(c.storage_options) if c.storage_options else None
        self.manager = CheckpointManager(c.root, cfg.trainer.run_name, c.keep_last, c.keep_every,
                                         storage_options=self.storage_options, on_corrupt=self._on_corrupt)
        self.pending: dict[str, Any] | None = None
        self.abandoned: int | None = None  # a save given up on: a surviving rank may still be writing it
        self.last_committed: int | None = None
        self.timeout_s = cfg.recovery.call_timeout_s  # the deadline of one call on the workers
        self.save_timeout_s = c.save_timeout_s  # how long a due save waits for the previous one
        self.max_skipped = c.max_skipped
        self.skipped_in_row = 0  # checkpoints skipped since the last commit
        # Whether files of uncommitted saves may lie in storage: an earlier controller's at first,
        # then what a skipped, refused or abandoned save of this one left. Cleaning up lists the
        # run's storage, so it is done only then, not at every recovery.
        self._leftovers = True
        self.lease: RunLease | None = None
        self.restorer = Restorer(self.manager, self.storage_options, self.on_event, self._on_corrupt)

    # ------------------------------------------------------------------ lease
    def acquire_lease(self, clock=None) -> Lease:
        """Take the run's lease (or raise LeaseHeldError naming its holder) and keep renewing it."""
        c = self.cfg.checkpoint
        if self.lease is None:
            extra = {"clock": clock} if clock is not None else {}
            self.lease = RunLease(self.manager.storage, self.run_name, c.lease_ttl_s, c.lease_renew_s,
                                  takeover=c.takeover, **extra)
        lease = self.lease.acquire(floor=self.manager.newest_fencing_token())
        self.manager.lease = self.lease
        self.lease.start_renewing()
        self.on_event("lease_acquired", holder=lease.holder, token=lease.token, expires_at=lease.expires_at,
                      previous=lease.previous)
        return lease

    def release_lease(self) -> None:
        """Stop renewing and release the lease (no-op when none is held)."""
        if self.lease is not None:
            self.lease.close()
            self.manager.lease = None
            self.lease = None

    def prepare(self) -> None:
        """Before the cluster starts, when this run saves checkpoints: check that the checkpoint
        root takes writes. (What killed writers left behind is cleared once this controller
        holds the run's lease: at the restore that starts every run.)"""
        if self.save_every == 0:
            return
        try:
            self.manager.storage.check_writable(self.run_name)
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint.root={self.root!r} cannot be written: {exc}") from exc

    def cleanup(self) -> list[int]:
        """Delete uncommitted step folders, stray temp files and incomplete uploads of this run,
        sparing a save in flight (or abandoned, whose surviving ranks may still be writing); the
        steps deleted. Nothing is read when no save can have left anything since the last clean-up."""
        if not self._leftovers:
            return []
        keep = [s for s in ((self.pending or {}).get("step"), self.abandoned) if s is not None]
        try:
            removed = self.manager.cleanup_uncommitted(exclude_step=keep)
        except StorageError as exc:  # housekeeping: never the reason a run stops
            logger.warning("cleaning up leftovers under %s failed (retried at the next start or "
                           "restore): %s", self.manager.run_url, exc)
            return []
        # A spared save left behind is cleaned once a later save is skipped, refused or abandoned
        # (which no longer spares it), or at the next start.
        self._leftovers = False
        return removed

    def _on_corrupt(self, step: int, reason: str) -> None:
        self.on_event("checkpoint_corrupt", step=step, reason=reason)
        if self.metrics is not None:
            self.metrics.record_corrupt_checkpoint()

    def last_committed_at(self) -> tuple[int, float] | None:
        """(step, commit time) of the last committed checkpoint of this timeline, if any; a
        checkpoint resumed from another run's folder, whose manifest is not readable here, is
        dated now."""
        step = self.last_committed
        if step is None:
            return None
        try:
            return step, self.manager.load_manifest(step).created_at
        except (RRLError, OSError):
            return step, time.time()

    def due(self, step: int) -> bool:
        return self.save_every > 0 and (step % self.save_every == 0 or step == self.cfg.trainer.total_steps)

    def restore(self, roles, resume: str = "auto") -> dict | None:
        """Load the checkpoint named by ``resume`` into every stateful role (see
        :meth:`Restorer.restore`); returns its trainer state, or None when the run starts from
        scratch."""
        self.fence()  # a controller that lost the run must not even choose what to load
        found = self.restorer.restore(roles, resume)
        if found is None:
            self.cleanup()
            return None
        state, step, duration, source = found
        self.last_committed = step
        self.cleanup()  # what the failure left half-written (the restored ranks' writers are closed)
        self.on_event("checkpoint_restored", step=step, duration_s=duration, source=source)
        if self.metrics is not None:
            self.metrics.record_checkpoint_load(duration)
        return state

    def _refuse(self, step: int, role: str, reason: str) -> None:
        """A save whose state is not finite: never committed (its folder is cleaned up later)."""
        logger.error("checkpoint of step %d not committed: %s", step, reason)
        self._leftovers = True
        self.on_event("nonfinite", step=step, quantity="checkpoint", role=role, action="refused")
        self.on_event("checkpoint_refused", step=step, role=role, reason=reason)

    # ------------------------------------------------------------------ save
    def save(self, roles, step: int, trainer_state: dict, digest: str, known_good: bool = True) -> float:
        """Start the save of ``step``; returns the time the step was blocked (stall).

        The previous save, if still writing, is waited for up to ``checkpoint.save_timeout_s``;
        past that this save is skipped (reason ``slow``). A storage outage skips it too
        (reason ``storage``); see :meth:`_skip`. ``known_good`` goes into the manifest: False when
        the run met a NaN/Inf since the last known-good checkpoint (the state saved is still
        checked to be finite)."""
        self._check_lease()
        if self.pending is not None and not self.wait(roles):
            self._skip(step, "slow", f"the save of step {self.pending['step']} is still being written after "
                                     f"checkpoint.save_timeout_s={self.save_timeout_s:g}s")
            return 0.0
        try:  # strict JSON: a NaN here would be written, then refused by the loader at resume
            json.dumps(trainer_state, allow_nan=False)
        except ValueError as exc:
            self._refuse(step, "controller", f"trainer state is not finite ({exc})")
            return 0.0
        t0 = time.perf_counter()
        try:
            self.manager.begin_step(step)
            self.manager.write_trainer_state(step, trainer_state)
        except StorageError as exc:
            if not is_outage(exc):
                raise self._stopping_error(exc)
            self._leftovers = True
            self._skip(step, "storage", str(exc))
            return time.perf_counter() - t0
        results = {role: g.save_checkpoint(self.root, self.storage_options, rel_for(self.manager, step, role),
                                           self.async_save)
                   for role, g in roles.checkpoint_groups()}
        stall = time.perf_counter() - t0
        self.pending = {"step": step, "t0": t0, "stall": stall, "digest": digest, "known_good": known_good,
                        "world_sizes": {role: g.world_size for role, g in roles.checkpoint_groups()}}
        self.on_event("checkpoint_started", step=step, stall_s=stall)
        if not self.async_save:
            self._settle(results)
        return stall

    def _answers(self, roles, timeout_s: float) -> dict[str, list]:
        return {role: g.checkpoint_done(timeout_s) for role, g in roles.checkpoint_groups()}

    def poll(self, roles) -> bool:
        """Commit (or skip) the save in flight if every rank has written; True when nothing is
        pending any more. Raises WorkerDiedError when a rank lost its writer (see :meth:`_settle`)."""
        self._check_lease()
        if self.pending is None:
            return True
        return self._settle(self._answers(roles, 0.0))

    def wait(self, roles, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (default ``checkpoint.save_timeout_s``) for the save in flight
        to be written, then commit (or skip) it; False when it is still being written."""
        if self.pending is None:
            return True
        timeout_s = self.save_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        # Each worker-side wait stays well inside the deadline of one group call
        # (recovery.call_timeout_s): a long save is waited for in slices, never as one long call.
        slice_s = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            remaining = deadline - time.monotonic()
            if self._settle(self._answers(roles, min(slice_s, remaining) if remaining > 0 else 0.0)):
                return True
            if remaining <= 0:
                return False

    def finish(self, roles) -> bool:
        """At the end of a run: wait (bounded) for the last save and commit it. A save still
        being written after ``checkpoint.save_timeout_s`` is reported and abandoned (the run's
        last committed checkpoint is the one before); returns whether nothing was left behind."""
        if self.wait(roles):
            return True
        step = self.pending["step"]
        logger.error("the checkpoint of step %d was still being written after checkpoint.save_timeout_s=%gs "
                     "at the end of the run: abandoned; the last committed checkpoint is step %s",
                     step, self.save_timeout_s, self.last_committed)
        self.abandon(reason="slow")
        return False

    def _settle(self, results: dict[str, list]) -> bool:
        """Act on every rank's answer about the save in flight: commit it, skip it (storage
        outage) or give it up; False while a rank is still writing.

        A rank answering ``[]`` holds no save: its process was restarted, so its shard is lost
        and the worker group is broken. The save is abandoned and WorkerDiedError raised, for
        the caller's recovery. A permanent storage error (no space left) raises StorageError."""
        step = self.pending["step"]
        lost = [(role, rank) for role, rs in results.items() for rank, r in enumerate(rs) if r == []]
        if lost:
            role, rank = lost[0]
            self.abandon(reason="writer_lost")
            raise WorkerDiedError(f"{role} rank {rank} holds no shard of the checkpoint of step {step}: its "
                                  "process was restarted while the save was written", role=role, rank=rank,
                                  cause="died")
        if any(r is None for rs in results.values() for r in rs):
            return False
        failed = [(role, rank, r) for role, rs in results.items() for rank, r in enumerate(rs) if isinstance(r, dict)]
        if failed:
            role, rank, r = failed[0]
            detail = f"{role} rank {rank} could not write its shards: {r.get('storage_error')}"
            if not r.get("outage"):
                self.abandon(reason="storage")
                raise self._stopping_error(StorageError(f"checkpoint of step {step}: {detail}"))
            self.pending = None
            self._leftovers = True
            self._skip(step, "storage", detail)
            return True
        self._commit(results)
        return True

    def _skip(self, step: int, reason: str, detail: str) -> None:
        """Record a checkpoint that was not saved (training goes on); raise
        CheckpointsSkippedError once more than ``checkpoint.max_skipped`` were skipped in a row."""
        self.skipped_in_row += 1
        logger.warning("checkpoint of step %d skipped (%s, %d in a row): %s", step, reason, self.skipped_in_row,
                       detail)
        self.on_event("checkpoint_skipped", step=step, reason=reason, in_row=self.skipped_in_row,
                      detail=detail[:500])
        if self.metrics is not None:
            self.metrics.record_checkpoint_skipped(reason)
        if self.skipped_in_row > self.max_skipped:
            raise CheckpointsSkippedError(
                f"{self.skipped_in_row} checkpoints in a row could not be saved (checkpoint.max_skipped="
                f"{self.max_skipped}); the last: step {step}, {reason}: {detail[:300]}; the last committed "
                f"checkpoint is step {self.last_committed}")

    def abandon(self, reason: str = "recovery") -> None:
        """Forget the save in flight (its ranks died or were reset): it is never committed."""
        if self.pending is not None:
            self.on_event("checkpoint_abandoned", step=self.pending["step"], reason=reason)
            self.abandoned = self.pending["step"]
            self._leftovers = True
        self.pending = None

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.raise_if_lost()  # found by the renewal thread; no storage access

    def _stopping_error(self, exc: StorageError) -> Exception:
        """What a storage error that stops the run is reported as: the lost lease when another
        controller took the run over meanwhile (a write of this one raced the takeover and failed on
        the new holder's clean-up of the step it was writing), else ``exc`` itself."""
        if self.lease is not None:
            try:
                self.lease.check()
            except LeaseLostError as lost:
                lost.__cause__ = exc
                return lost
            except StorageError:  # the lease cannot be read either: the storage error stands
                pass
        return exc

    def fence(self) -> None:
        """Raise LeaseLostError if another controller took the run over (reads the lease now);
        a no-op without a lease. Guards writes outside checkpoints, e.g. the metrics log."""
        if self.lease is not None:
            self.lease.check()

    def _commit(self, results: dict[str, list]) -> None:
        p = self.pending
        bad = sorted({role for role, rs in results.items() for per_rank in rs for rec in per_rank
                      if not rec.get("finite", True)})
        if bad:
            self.pending = None
            self._refuse(p["step"], ",".join(bad), f"the saved state of {', '.join(bad)} holds NaN or Inf")
            return
        files = {role: [FileRecord.from_json(rec) for per_rank in rs for rec in per_rank]
                 for role, rs in results.items()}
        try:
            self.manager.commit(p["step"], files, p["world_sizes"], p["digest"], known_good=p.get("known_good", True))
        except StorageError as exc:  # manifest, ``latest`` or retention: the storage went away
            if not is_outage(exc):
                raise self._stopping_error(exc)
            self.pending = None
            self._leftovers = True
            self._skip(p["step"], "storage", f"commit: {exc}")
            return
        except CheckpointCorruptError as exc:  # a shard is not what its writer reported: never committed
            self.pending = None
            self._leftovers = True
            self._skip(p["step"], "storage", f"commit: {exc}")
            return
        duration = time.perf_counter() - p["t0"]
        nbytes = sum(r.size for rs in files.values() for r in rs)
        self.last_committed = p["step"]
        self.pending = None
        self.skipped_in_row = 0
        self.on_event("checkpoint_committed", step=p["step"], duration_s=duration, stall_s=p["stall"], bytes=nbytes,
                      known_good=p.get("known_good", True))
        if self.metrics is not None:
            self.metrics.record_checkpoint_save(duration, p["stall"], nbytes, p["step"])
        if self._leftovers:  # what skipped saves left half-written, now that storage answers again
            self.cleanup()
