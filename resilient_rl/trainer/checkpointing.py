"""Controller side of checkpoints: when to save, the commit once every rank has written, restore.

The controller writes ``trainer_state.json`` (step, data loader position, KL controller, failure
counters, RNG), asks every rank of the trainable roles to stage and write its shards, and commits
the step (manifest, then ``latest``) only after every rank has reported its files. At most one save
is in flight. A step whose state holds a NaN or Inf (a worker's shard, or the controller's own
state) is never committed: the save is refused with a ``checkpoint_refused`` event. Restoring
picks the newest committed checkpoint that verifies (a corrupt one is reported and skipped), or
the newest known-good one for a rollback after a NaN, loads every role into its current world
size and returns the controller state to continue from.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from resilient_rl.checkpoint import CheckpointManager, FileRecord, Storage, step_dirname
from resilient_rl.errors import CheckpointError, CheckpointNotFoundError, ConfigError

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
        self.last_committed: int | None = None
        self.timeout_s = cfg.recovery.call_timeout_s

    def _on_corrupt(self, step: int, reason: str) -> None:
        self.on_event("checkpoint_corrupt", step=step, reason=reason)
        if self.metrics is not None:
            self.metrics.record_corrupt_checkpoint()

    def due(self, step: int) -> bool:
        return self.save_every > 0 and (step % self.save_every == 0 or step == self.cfg.trainer.total_steps)

    def _groups(self, roles) -> list[tuple[str, Any]]:
        return [(r, roles.groups[r]) for r in STATEFUL_ROLES if r in roles.groups]

    def _rel(self, step: int, role: str) -> str:
        return Storage.join(self.run_name, step_dirname(step), role)

    def _refuse(self, step: int, role: str, reason: str) -> None:
        """A save whose state is not finite: never committed (its folder is cleaned up later)."""
        logger.error("checkpoint of step %d not committed: %s", step, reason)
        self.on_event("nonfinite", step=step, quantity="checkpoint", role=role, action="refused")
        self.on_event("checkpoint_refused", step=step, role=role, reason=reason)
        if self.metrics is not None and hasattr(self.metrics, "record_nonfinite"):
            self.metrics.record_nonfinite("checkpoint", "refused")

    # ------------------------------------------------------------------ save
    def save(self, roles, step: int, trainer_state: dict, digest: str, known_good: bool = True) -> float:
        """Start the save of ``step``; returns the time the step was blocked (stall).

        ``known_good`` goes into the manifest: False when the run met a NaN/Inf since the last
        known-good checkpoint (the state saved is still checked to be finite)."""
        self.wait(roles)
        try:  # strict JSON: a NaN here would be written, then refused by the loader at resume
            json.dumps(trainer_state, allow_nan=False)
        except ValueError as exc:
            self._refuse(step, "controller", f"trainer state is not finite ({exc})")
            return 0.0
        t0 = time.perf_counter()
        self.manager.begin_step(step)
        self.manager.write_trainer_state(step, trainer_state)
        results = {role: g.save_checkpoint(self.root, self.storage_options, self._rel(step, role), self.async_save)
                   for role, g in self._groups(roles)}
        stall = time.perf_counter() - t0
        self.pending = {"step": step, "t0": t0, "stall": stall, "digest": digest, "known_good": known_good,
                        "world_sizes": {role: g.world_size for role, g in self._groups(roles)}}
        self.on_event("checkpoint_started", step=step, stall_s=stall)
        if not self.async_save:
            self._commit(results)
        return stall

    def poll(self, roles) -> bool:
        """Commit the save in flight if every rank has written; True when nothing is pending any more."""
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
        self.pending = None

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
        self.manager.commit(p["step"], files, p["world_sizes"], p["digest"], known_good=p.get("known_good", True))
        duration = time.perf_counter() - p["t0"]
        nbytes = sum(r.size for rs in files.values() for r in rs)
        self.last_committed = p["step"]
        self.pending = None
        self.on_event("checkpoint_committed", step=p["step"], duration_s=duration, stall_s=p["stall"], bytes=nbytes,
                      known_good=p.get("known_good", True))
        if self.metrics is not None:
            self.metrics.record_checkpoint_save(duration, p["stall"], nbytes, p["step"])

    # ------------------------------------------------------------------ restore
    def _source(self, resume: str) -> tuple[CheckpointManager, int] | None:
        if resume == "off":
            return None
        if resume.startswith("path:"):
            root, run, step = _split_step_url(resume[5:])
            manager = CheckpointManager(root, run, storage_options=self.storage_options, on_corrupt=self._on_corrupt)
            if manager.verify(step) != "ok":
                raise CheckpointError(f"checkpoint {resume[5:]} is {manager.verify(step)}")
            return manager, step
        if resume == "known_good":
            return self._latest_known_good()
        step = self.manager.find_latest_valid()
        return (self.manager, step) if step is not None else None

    def _latest_known_good(self) -> tuple[CheckpointManager, int] | None:
        """The newest committed checkpoint that verifies and is known good (a rollback after a NaN)."""
        for step in reversed(self.manager.committed_steps()):
            try:
                if self.manager.load_manifest(step).known_good and self.manager.verify(step) == "ok":
                    return self.manager, step
            except CheckpointError as exc:
                logger.error("checkpoint of step %d skipped for a rollback: %s", step, exc)
        return None

    def latest_valid(self) -> int | None:
        return self.manager.find_latest_valid()

    def restore(self, roles, resume: str = "auto") -> dict | None:
        """Load the checkpoint named by ``resume`` into every stateful role; returns its trainer state.

        ``resume``: ``auto`` (newest valid), ``known_good`` (newest valid and known good),
        ``path:...`` (that step folder) or ``off``."""
        found = self._source(resume)
        if found is None:
            if resume.startswith("path:"):
                raise CheckpointNotFoundError(f"no checkpoint at {resume[5:]}")
            return None
        manager, step = found
        t0 = time.perf_counter()
        manifest = manager.load_manifest(step)
        state = manager.load_trainer_state(step)
        for role, g in self._groups(roles):
            if role not in manifest.world_sizes:
                raise CheckpointError(f"checkpoint {manager.step_dir(step)} has no {role!r} state")
            files = [r.to_json() for r in manager.role_files(step, role)]
            g.load_checkpoint(manager.storage.url_for(""), self.storage_options, self._rel_for(manager, step, role), files,
                              manifest.world_sizes[role])
        duration = time.perf_counter() - t0
        self.last_committed = step
        self.on_event("checkpoint_restored", step=step, duration_s=duration, source=manager.step_dir(step))
        if self.metrics is not None:
            self.metrics.record_checkpoint_load(duration)
        return state

    @staticmethod
    def _rel_for(manager: CheckpointManager, step: int, role: str) -> str:
        return Storage.join(manager.run_name, step_dirname(step), role)
