"""The recovery state machine: the controller's explicit state and the transitions it allows.

RUNNING -> RECOVERING (wait for restarted or replaced actors) -> REJOINING (new-generation
rendezvous) -> RESTORING (newest snapshot or valid checkpoint) -> RUNNING. A failure during
recovery goes back to RECOVERING; past the budget, ABORTING -> FAILED. Any other transition is a
bug and raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from resilient_rl.errors import RRLError


class RecoveryState(Enum):
    RUNNING = "running"
    RECOVERING = "recovering"
    REJOINING = "rejoining"
    RESTORING = "restoring"
    ABORTING = "aborting"
    FAILED = "failed"


S = RecoveryState
ALLOWED: dict[RecoveryState, frozenset[RecoveryState]] = {
    S.RUNNING: frozenset({S.RECOVERING}),  # every failure is decided in RECOVERING
    S.RECOVERING: frozenset({S.REJOINING, S.RECOVERING, S.ABORTING}),
    S.REJOINING: frozenset({S.RESTORING, S.RECOVERING, S.ABORTING}),
    S.RESTORING: frozenset({S.RUNNING, S.RECOVERING, S.ABORTING}),
    S.ABORTING: frozenset({S.FAILED}),
    S.FAILED: frozenset(),
}


class IllegalTransition(RRLError):
    """A state change the recovery protocol does not allow (a bug in the controller)."""


@dataclass
class RecoveryStateMachine:
    """The controller's recovery state with its allowed transitions and a timestamped history."""

    state: RecoveryState = S.RUNNING
    history: list[tuple[float, RecoveryState, RecoveryState]] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def to(self, new: RecoveryState) -> None:
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"recovery: {self.state.value} -> {new.value} is not allowed")
        self.history.append((self.clock(), self.state, new))
        self.state = new
