"""Rolling a run back to a point: the one way a run goes back in time.

A *point* is a state the run can continue from: the newest complete in-memory snapshot, a
committed checkpoint (``checkpoint.resume`` spelling: ``auto``, ``known_good``, ``path:...``,
``off``), or the run's initial state. Resuming a run, recovering from a failure and rolling back
past a NaN all go through :meth:`RollBack.roll_back_to`:

1. the roles get the point's state (a snapshot or checkpoint is loaded into the stateful roles;
   the start rebuilds every model from its initial weights);
2. the controller's registered state (step, data position, KL coefficient, failure budget, the
   NaN guard's counters) gets the point's; a NaN rollback keeps the data position, so the next
   step trains on new data, and the NaN guard's counters, so its budget is not refilled
   (:data:`KEPT_AFTER_NONFINITE`);
3. the rollout gets the restored weights, the metric rows after the point are dropped from the
   run folder and from the bounded in-memory history, and so are the snapshots of the abandoned
   steps.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from resilient_rl.checkpoint.controller_state import ControllerState
from resilient_rl.errors import CheckpointCorruptError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    """Where to roll back to: ``snapshot``, ``checkpoint`` (which one: ``resume``) or ``start``."""

    kind: str
    resume: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in ("snapshot", "checkpoint", "start"):
            raise ValueError(f"a roll-back point is a snapshot, a checkpoint or the start, not {self.kind!r}")


SNAPSHOT = Point("snapshot")
START = Point("start")


def checkpoint(resume: str = "auto") -> Point:
    """The committed checkpoint ``resume`` names (``auto``: the newest that verifies)."""
    return Point("checkpoint", resume)


#: After a failure: the newest complete snapshot, else the newest valid checkpoint, else the start.
AFTER_FAILURE = (SNAPSHOT, checkpoint("auto"), START)
#: After a NaN: the newest known-good checkpoint, else the start.
AFTER_NONFINITE = (checkpoint("known_good"), START)
#: The controller's parts a NaN rollback keeps: the data position and the NaN guard's counters.
KEPT_AFTER_NONFINITE = ("loader", "nonfinite")


class RollBack:
    """Rolls roles and controller back to a :class:`Point`.

    Args:
        checkpoints: the checkpoint coordinator (``restore``, ``fence``, ``cleanup``, ``last_committed``).
        snapshots: the snapshot keeper, or None when snapshots are off.
        state: the controller's registered state; what it holds now is the run's initial state.
        run_dir: the run folder (its metric rows after the point are dropped).
        history: the trainer's bounded in-memory history of metric rows, refilled from the run folder.
        digest: the config digest, compared with a loaded state's.
    """

    def __init__(self, checkpoints, snapshots, state: ControllerState, run_dir, history: deque, digest: str):
        self.checkpoints = checkpoints
        self.snapshots = snapshots
        self.state = state
        self.initial_state = state.state_dict()  # what a run with no valid checkpoint restarts from
        self.run_dir = run_dir
        self.history = history
        self.digest = digest
        # Digests of checkpoints whose config was checked key by key before the run started (and
        # warned about there, naming the keys): loading them is not warned about again.
        self.accepted_digests: set[str] = set()
        self.source: str | None = None  # where the last roll-back went (the recovered event)

    def roll_back_to(self, roles, *points: Point, keep: tuple[str, ...] = ()) -> int | None:
        """Roll the run back to the first of ``points`` that exists; its step, or None when none
        does (nothing changed then, but a snapshot that only some ranks held leaves fresh models
        behind for the next point). A chain ending with :data:`START` always rolls back. The
        controller's parts named in ``keep`` stay as they are now."""
        kept = {name: self.state.value(name) for name in keep}
        for point in points:
            state = self._load(roles, point)
            if state is not None:
                break
        else:
            return None
        self.load_controller_state(state, checked=point.kind == "checkpoint")
        for name, value in kept.items():
            self.state.part(name).load_state_dict(value)
        self.source = point.kind
        step = self.state.value("step")
        roles.sync_weights(step)
        # Every row is recorded in the folder and the history together: when the history's newest
        # row is not past the point, neither is the folder's, and the (long) file is not read.
        if not self.history or self.history[-1]["step"] > step:
            self.run_dir.truncate_metrics_after(step)
            self.history.clear()
            self.history.extend(self.run_dir.read_metrics(last=self.history.maxlen))
        if self.snapshots is not None:  # the steps after the point are not this timeline's
            self.snapshots.drop_after(step)
        return step

    def _load(self, roles, point: Point) -> dict | None:
        """Load ``point``'s state into the roles; the controller's part of it, or None when there is no such point."""
        if point.kind == "snapshot":
            return self._snapshot(roles)
        if point.kind == "checkpoint":
            return self.checkpoints.restore(roles, point.resume)
        roles.init_models()  # the start: the groups a recovery did not rebuild kept their weights
        return self.initial_state

    def _snapshot(self, roles) -> dict | None:
        """Load the newest complete snapshot not older than the last commit; its trainer state."""
        if self.snapshots is None:
            return None
        self.checkpoints.fence()
        snap = self.snapshots.restore(roles, self.checkpoints.last_committed)
        if snap is None:
            if self.snapshots.partial:  # some ranks hold part of a snapshot: back to fresh models
                roles.init_models()
            return None
        self.checkpoints.cleanup()  # what an abandoned save left half-written
        return snap.trainer_state

    def load_controller_state(self, state: dict[str, Any], checked: bool = False) -> None:
        """Load the controller's part of a checkpoint or snapshot. ``checked``: the state was read
        from storage, where a malformed one is a crafted or damaged checkpoint."""
        try:
            self.state.load_state_dict(state)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if not checked:
                raise
            raise CheckpointCorruptError(f"trainer_state.json of step {state.get('step')}: malformed "
                                         f"controller state ({exc!r})") from exc
        if state.get("config_digest") not in (None, self.digest, *self.accepted_digests):
            logger.warning("resuming a checkpoint written with a different config (digest %s, now %s)",
                           state.get("config_digest"), self.digest)
