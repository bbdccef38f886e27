"""Controller side of restoring a checkpoint: which one, and loading it into every stateful role.

Restoring picks the newest committed checkpoint that verifies (a corrupt one is reported and
skipped), loads every role into its current world size and returns the controller state to
continue from. One timeline per run: restoring step S (from ``auto``, a ``path:`` or, with
``resume=off``, nothing) sets the run's newer committed steps aside, and a later recovery restores
from this timeline only: the run's own newest commit, else the checkpoint it was resumed from.
A rollback after a NaN restores the newest known-good checkpoint of the timeline
(``resume=known_good``). A run whose base is gone (the other run's retention deleted it) before it
committed a step of its own stops (NoValidCheckpointError) instead of starting over. A ``path:``
that names this run's own step by another spelling (a symlink, ``..``, ``s3a://`` for ``s3://``)
is this run's step: its newer steps are set aside, not every one.
When committed steps exist but none verifies, restoring stops (NoValidCheckpointError) instead of
starting over, and a checkpoint of a newer format stops it too (CheckpointFormatError): neither
sets the run's steps aside or lets the metric history be cut.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from resilient_rl.checkpoint import MANIFEST_NAME, CheckpointManager, Storage, step_dirname
from resilient_rl.errors import (CheckpointCorruptError, CheckpointError, CheckpointFormatError, CheckpointNotFoundError,
                                 ConfigError, NoValidCheckpointError)

logger = logging.getLogger(__name__)


def split_step_url(url: str) -> tuple[str, str, int]:
    """``{root}/{run}/step_{N}`` -> (root, run, N), for ``checkpoint.resume=path:...``; a run
    folder at the top of a file system (``/my-run/step_N``) has the root ``/``."""
    parts = url.rstrip("/").rsplit("/", 2)
    expected = "expected a step folder such as path:checkpoints/my-run/step_00000020"
    if len(parts) != 3 or not parts[1] or not parts[2].startswith("step_") or not parts[2][5:].isdigit():
        raise ConfigError(f"checkpoint.resume=path:{url}: {expected}")
    root = parts[0] or ("/" if url.startswith("/") else "")
    if not root or root.endswith((":", ":/")):
        raise ConfigError(f"checkpoint.resume=path:{url}: names no folder above the run's ({expected})")
    return root, parts[1], int(parts[2][5:])


class Restorer:
    """Chooses the checkpoint a run continues from and loads it into every stateful role.

    Args:
        manager: the run's checkpoint manager.
        storage_options: fsspec options of the checkpoint storage (also for ``path:`` checkpoints).
        on_event: ``on_event(kind, **fields)`` records an event of the run.
        on_corrupt: called with ``(step, reason)`` for a checkpoint that fails verification.
    """

    def __init__(self, manager: CheckpointManager, storage_options: dict | None, on_event: Callable[..., None],
                 on_corrupt: Callable[[int, str], None]):
        self.manager = manager
        self.storage_options = storage_options
        self.on_event = on_event
        self._on_corrupt = on_corrupt
        # Where this run's timeline starts when it was resumed from another run's checkpoint:
        # recovery falls back to it until the run commits a step of its own.
        self.base: tuple[CheckpointManager, int] | None = None

    def _source(self, resume: str) -> tuple[CheckpointManager, int] | None:
        if resume == "off":
            return None
        if resume.startswith("path:"):
            root, run, step = split_step_url(resume[5:])
            manager = CheckpointManager(root, run, storage_options=self.storage_options, on_corrupt=self._on_corrupt)
            status = manager.verify(step)
            if status.startswith("corrupt"):
                raise CheckpointCorruptError(f"checkpoint {resume[5:]} is {status}")
            if status != "ok" and not manager.storage.find(manager.step_rel(step)):
                raise CheckpointNotFoundError(f"checkpoint.resume=path:{resume[5:]}: no such checkpoint (nothing is "
                                              f"stored at {manager.step_dir(step)})")
            if status != "ok":
                raise CheckpointNotFoundError(f"checkpoint {resume[5:]} is {status} (it has no {MANIFEST_NAME}: its "
                                              "save did not finish)")
            return manager, step
        if resume == "known_good":
            return self._latest_known_good()
        step = self.manager.find_latest_valid()
        if step is not None:
            return self.manager, step
        if self.base is not None:  # resumed from another run and nothing committed since
            manager, step = self.base
            status = manager.verify(step)
            if status == "ok":
                return manager, step
            # Starting over would throw away the resumed progress, and cut the metric history to nothing.
            raise NoValidCheckpointError(
                f"the checkpoint this run was resumed from, {manager.step_dir(step)}, is now {status}, and the run "
                f"has committed no checkpoint of its own since: stopping instead of starting over from scratch. "
                f"Resume it again with checkpoint.resume=path:<another step folder>, or start it over with "
                f"checkpoint.resume=off")
        return None

    def _refuse_to_discard(self) -> None:
        """Committed steps exist and none verifies: starting over would set every one of them
        aside and cut the metric history to nothing, so stop instead (only ``resume=off`` does that)."""
        steps = self.manager.timeline_steps()
        if steps:
            raise NoValidCheckpointError(
                f"none of the committed checkpoints of run {self.manager.run_url} verifies (steps "
                f"{', '.join(map(str, steps))}; each is reported in a checkpoint_corrupt event). Stopping without "
                "setting them aside or cutting the metric history: inspect them with `resilient-rl checkpoints "
                "verify`; to start the run over from scratch, pass checkpoint.resume=off")

    def _latest_known_good(self) -> tuple[CheckpointManager, int] | None:
        """The newest committed checkpoint that verifies and is known good (a rollback after a NaN)."""
        for step in reversed(self.manager.timeline_steps()):
            try:
                if self.manager.load_manifest(step).known_good and self.manager.verify(step) == "ok":
                    return self.manager, step
            except CheckpointFormatError:
                raise  # a newer version's checkpoint is not skipped (and so set aside) as if corrupt
            except CheckpointError as exc:
                logger.error("checkpoint of step %d skipped for a rollback: %s", step, exc)
        return None

    def _begin_timeline(self, manager: CheckpointManager | None, step: int | None, resume: str) -> None:
        """The run continues from ``step`` of ``manager`` (None: from scratch): set aside the
        run's committed steps that are not on that timeline, so neither ``latest``, ``auto`` nor a
        recovery ever loads them."""
        if manager is None or not self.manager.same_run(manager):
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

    def restore(self, roles, resume: str = "auto") -> tuple[dict, int, float, str] | None:
        """Load the checkpoint named by ``resume`` into every stateful role: (its trainer state, its
        step, the seconds loading took, its folder), or None when there is none (the run starts
        from scratch). The run's committed steps that are not on the resumed timeline are set
        aside (see :meth:`_begin_timeline`).

        ``resume``: ``auto`` (newest valid), ``known_good`` (newest valid and known good: a
        rollback after a NaN), ``path:...`` (that step folder) or ``off``."""
        found = self._source(resume)
        if found is None:
            if resume.startswith("path:"):
                raise CheckpointNotFoundError(f"no checkpoint at {resume[5:]}")
            if resume != "off":
                self._refuse_to_discard()
            self._begin_timeline(None, None, resume)
            return None
        manager, step = found
        t0 = time.perf_counter()
        manifest = manager.load_manifest(step)
        state = manager.load_trainer_state(step)
        if state.get("step") != step or isinstance(state.get("step"), bool):
            raise CheckpointCorruptError(f"{manager.step_dir(step)}/trainer_state.json: holds step "
                                         f"{str(state.get('step'))[:40]}, the manifest step {step}")
        for role, g in roles.checkpoint_groups():
            if role not in manifest.world_sizes:
                raise CheckpointError(f"checkpoint {manager.step_dir(step)} has no {role!r} state")
            files = [r.to_json() for r in manager.role_files(step, role)]
            g.load_checkpoint(manager.storage.url_for(""), self.storage_options, rel_for(manager, step, role), files,
                              manifest.world_sizes[role])
        self._begin_timeline(manager, step, resume)
        return state, step, time.perf_counter() - t0, manager.step_dir(step)


def rel_for(manager: CheckpointManager, step: int, role: str) -> str:
    """The folder of ``role``'s shards of ``step``, relative to the storage root."""
    return Storage.join(manager.run_name, step_dirname(step), role)
