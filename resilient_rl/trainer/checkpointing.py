"""Controller side of checkpoints: when to save, the commit once every rank has written, restore.

The controller writes ``trainer_state.json`` (step, data loader position, KL controller, failure
counters, RNG), asks every rank of the trainable roles to stage and write its shards, and commits
the step (manifest, then ``latest``) only after every rank has reported its files. At most one save
is in flight. Restoring picks the newest committed checkpoint that verifies (a corrupt one is
reported and skipped), loads every role into its current world size and returns the controller
state to continue from.

One writer per run: before writing, the controller takes the run's lease (``acquire_lease``,
``checkpoint/lease.py``); every commit and deletion checks it, and its fencing token goes into
each manifest. One timeline per run: restoring step S (from ``auto``, a ``path:`` or, with
``resume=off``, nothing) sets the run's newer committed steps aside, and a later recovery restores
from this timeline only: the run's own newest commit, else the checkpoint it was resumed from.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from resilient_rl.checkpoint import CheckpointManager, FileRecord, Storage, step_dirname
from resilient_rl.checkpoint.lease import Lease, RunLease
from resilient_rl.errors import (CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError,
                                 StorageError)

logger = logging.getLogger(__name__)

#: Roles whose state lives in checkpoints (ref is rebuilt from its source, rollout gets the actor's weights).
STATEFUL_ROLES = ("actor", "critic")


def _split_step_url(url: str) -> tuple[str, str, int]:
    """``{root}/{run}/step_{N}`` -> (root, run, N), for ``checkpoint.resume=path:...``."""
    parts = url.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or not parts[2].startswith("step_") or not parts[2][5:].isdigit():
        raise ConfigError(f"checkpoint.resume=path:{url}: expected a step folder such as "
                          "path:checkpoints/my-run/step_00000020")
    return parts[0], parts[1], int(parts[2][5:])


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
        self.timeout_s = cfg.recovery.call_timeout_s
        self.lease: RunLease | None = None
        # Where this run's timeline starts when it was resumed from another run's checkpoint:
        # recovery falls back to it until the run commits a step of its own.
        self.base: tuple[CheckpointManager, int] | None = None

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
        sparing a save in flight (or abandoned, whose surviving ranks may still be writing)."""
        keep = [s for s in ((self.pending or {}).get("step"), self.abandoned) if s is not None]
        try:
            return self.manager.cleanup_uncommitted(exclude_step=keep)
        except StorageError as exc:  # housekeeping: never the reason a run stops
            logger.warning("cleaning up leftovers under %s failed (retried at the next start or "
                           "restore): %s", self.manager.run_url, exc)
            return []

    def _on_corrupt(self, step: int, reason: str) -> None:
        self.on_event("checkpoint_corrupt", step=step, reason=reason)
        if self.metrics is not None:
            self.metrics.record_corrupt_checkpoint()

    def due(self, step: int) -> bool:
        return self.save_every > 0 and (step % self.save_every == 0 or step == self.cfg.trainer.total_steps)

    def _groups(self, roles) -> list[tuple[str, Any]]:
        return [(r, roles.groups[r]) for r in STATEFUL_ROLES if r in roles.groups]

    # ------------------------------------------------------------------ save
    def save(self, roles, step: int, trainer_state: dict, digest: str) -> float:
        """Start the save of ``step``; returns the time the step was blocked (stall)."""
        self._check_lease()
        self.wait(roles)
        t0 = time.perf_counter()
        self.manager.begin_step(step)
        self.manager.write_trainer_state(step, trainer_state)
        results = {role: g.save_checkpoint(self.root, self.storage_options, self._rel_for(self.manager, step, role), self.async_save)
                   for role, g in self._groups(roles)}
        stall = time.perf_counter() - t0
        self.pending = {"step": step, "t0": t0, "stall": stall, "digest": digest,
                        "world_sizes": {role: g.world_size for role, g in self._groups(roles)}}
        self.on_event("checkpoint_started", step=step, stall_s=stall)
        if not self.async_save:
            self._commit(results)
        return stall

    def poll(self, roles) -> bool:
        """Commit the save in flight if every rank has written; True when nothing is pending any more."""
        self._check_lease()
        if self.pending is None:
            return True
        results = {role: g.checkpoint_done(0.0) for role, g in self._groups(roles)}
        if any(r is None for rs in results.values() for r in rs):
            return False
        self._commit(results)
        return True

    def wait(self, roles) -> None:
        """Block until the save in flight is written and committed."""
        if self.pending is None:
            return
        results = {role: g.checkpoint_done(self.timeout_s) for role, g in self._groups(roles)}
        if any(r is None for rs in results.values() for r in rs):
            raise CheckpointError(f"checkpoint of step {self.pending['step']} was not written within {self.timeout_s}s")
        self._commit(results)

    def abandon(self) -> None:
        """Forget the save in flight (its ranks died or were reset): it is never committed."""
        if self.pending is not None:
            self.on_event("checkpoint_abandoned", step=self.pending["step"])
            self.abandoned = self.pending["step"]
        self.pending = None

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.raise_if_lost()  # found by the renewal thread; no storage access

    def fence(self) -> None:
        """Raise LeaseLostError if another controller took the run over (reads the lease now);
        a no-op without a lease. Guards writes outside checkpoints, e.g. the metrics log."""
        if self.lease is not None:
            self.lease.check()

    def _commit(self, results: dict[str, list]) -> None:
        p = self.pending
        files = {role: [FileRecord.from_json(rec) for per_rank in rs for rec in per_rank]
                 for role, rs in results.items()}
        self.manager.commit(p["step"], files, p["world_sizes"], p["digest"])
        duration = time.perf_counter() - p["t0"]
        nbytes = sum(r.size for rs in files.values() for r in rs)
        self.last_committed = p["step"]
        self.pending = None
        self.on_event("checkpoint_committed", step=p["step"], duration_s=duration, stall_s=p["stall"], bytes=nbytes)
        if self.metrics is not None:
            self.metrics.record_checkpoint_save(duration, p["stall"], nbytes, p["step"])

    # ------------------------------------------------------------------ restore
    def _source(self, resume: str) -> tuple[CheckpointManager, int] | None:
        if resume == "off":
            return None
        if resume.startswith("path:"):
            root, run, step = _split_step_url(resume[5:])
            manager = CheckpointManager(root, run, storage_options=self.storage_options, on_corrupt=self._on_corrupt)
            status = manager.verify(step)
            if status.startswith("corrupt"):
                raise CheckpointCorruptError(f"checkpoint {resume[5:]} is {status}")
            if status != "ok":
                raise CheckpointNotFoundError(f"checkpoint {resume[5:]} is {status}")
            return manager, step
        step = self.manager.find_latest_valid()
        if step is not None:
            return self.manager, step
        if self.base is not None:  # resumed from another run and nothing committed since
            manager, step = self.base
            status = manager.verify(step)
            if status == "ok":
                return manager, step
            logger.error("the checkpoint this run was resumed from, %s, is now %s", manager.step_dir(step), status)
        return None

    def _same_run(self, manager: CheckpointManager) -> bool:
        return manager.run_url == self.manager.run_url

    def _begin_timeline(self, manager: CheckpointManager | None, step: int | None, resume: str) -> None:
        """The run continues from ``step`` of ``manager`` (None: from scratch): set aside the
        run's committed steps that are not on that timeline, so neither ``latest``, ``auto`` nor a
        recovery ever loads them."""
        if manager is None or not self._same_run(manager):
            if manager is not None:
                self.base = (manager, step)
            where = manager.step_dir(step) if manager is not None else "scratch (no checkpoint)"
            moved = self.manager.set_aside_newer(None, f"the run continued from {where} (checkpoint.resume={resume})")
        else:
            moved = self.manager.set_aside_newer(
                step, f"the run continued from its step {step} (checkpoint.resume={resume})")
        if moved:
            self.on_event("checkpoints_set_aside", steps=moved, continued_from=step,
                          source=manager.step_dir(step) if manager is not None else None)

    def restore(self, roles, resume: str = "auto") -> dict | None:
        """Load the checkpoint named by ``resume`` into every stateful role; returns its trainer state
        (None when there is none: the run starts from scratch). The run's committed steps that are
        not on the resumed timeline are set aside (see :meth:`_begin_timeline`)."""
        self.fence()  # a controller that lost the run must not even choose what to load
        found = self._source(resume)
        if found is None:
            if resume.startswith("path:"):
                raise CheckpointNotFoundError(f"no checkpoint at {resume[5:]}")
            self._begin_timeline(None, None, resume)
            self.cleanup()
            return None
        manager, step = found
        t0 = time.perf_counter()
        manifest = manager.load_manifest(step)
        state = manager.load_trainer_state(step)
        if state.get("step") != step or isinstance(state.get("step"), bool):
            raise CheckpointCorruptError(f"{manager.step_dir(step)}/trainer_state.json: holds step "
                                         f"{str(state.get('step'))[:40]}, the manifest step {step}")
        for role, g in self._groups(roles):
            if role not in manifest.world_sizes:
                raise CheckpointError(f"checkpoint {manager.step_dir(step)} has no {role!r} state")
            files = [r.to_json() for r in manager.role_files(step, role)]
            g.load_checkpoint(manager.storage.url_for(""), self.storage_options, self._rel_for(manager, step, role), files,
                              manifest.world_sizes[role])
        self._begin_timeline(manager, step, resume)
        duration = time.perf_counter() - t0
        self.last_committed = step
        self.cleanup()  # what the failure left half-written (the restored ranks' writers are closed)
        self.on_event("checkpoint_restored", step=step, duration_s=duration, source=manager.step_dir(step))
        if self.metrics is not None:
            self.metrics.record_checkpoint_load(duration)
        return state

    @staticmethod
    def _rel_for(manager: CheckpointManager, step: int, role: str) -> str:
        return Storage.join(manager.run_name, step_dirname(step), role)
