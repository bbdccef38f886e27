"""Failure classification, the failure policy and the recovery state machine.

Everything here is pure (no Ray calls), so the decisions are unit-tested without a cluster:

- :class:`FailurePolicy` maps a failure and the counters to RETRY or RAISE, with a restart budget
  per actor (``max_restarts``) and per time window for the job (``max_failures`` in
  ``failure_window_s``). Errors that replaying cannot fix (a bug raising in user code, a bad
  config) are RAISE at once.
- :class:`RecoveryStateMachine` is the controller's explicit state: RUNNING -> RECOVERING (wait for
  restarted or replaced actors) -> REJOINING (new-generation rendezvous) -> RESTORING (latest valid
  checkpoint) -> RUNNING. A failure during recovery goes back to RECOVERING; past the budget,
  ABORTING -> FAILED. Any other transition is a bug and raises.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable

from resilient_rl.errors import (CollectiveError, RRLError, StorageError, WorkerDiedError, WorkerError,
                                 WorkerTimeoutError)

class Cause(str, Enum):
    """Why a step (or a recovery) failed; assigned once, by :func:`classify`.

    A ``str`` enum: its value is what events, logs and the ``cause`` metric label carry.
    """

    DIED = "died"                # a worker process exited (SIGKILL, OOM, crash)
    TIMEOUT = "timeout"          # a call passed its ceiling
    HANG = "hang"                # a rank stopped advancing inside a call
    COLLECTIVE = "collective"    # a collective broke (a peer died or left)
    NODE_LOST = "node_lost"      # the node under a worker went away
    UNAVAILABLE = "unavailable"  # a worker cannot be reached (restarting, network)
    STORAGE = "storage"          # checkpoint storage unreachable past its retries
    EXHAUSTED = "exhausted"      # Ray has no restarts left for an actor
    STALE_WEIGHTS = "stale_weights"  # the rollout does not hold the weights it should
    ERROR = "error"              # a project error (bad config, corrupt state): a bug to fix
    EXCEPTION = "exception"      # an exception raised by user or library code
    UNKNOWN = "unknown"          # a worker error nothing more is known about

    @classmethod
    def of(cls, value: str | None) -> "Cause":
        """The cause named ``value``; unknown or missing names are :attr:`UNKNOWN`."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


#: Causes a replay can fix: infrastructure failures, not bugs.
RECOVERABLE_CAUSES = frozenset({Cause.DIED, Cause.TIMEOUT, Cause.HANG, Cause.COLLECTIVE, Cause.NODE_LOST,
                                Cause.UNAVAILABLE, Cause.STORAGE})


@dataclass(frozen=True)
class Failure:
    """One observed failure: which worker (as the error names it), why, when."""

    role: str | None
    rank: int | None
    cause: Cause
    message: str
    time: float


def classify(exc: BaseException, now: float | None = None) -> Failure:
    """A :class:`Failure` from an exception raised while driving the workers."""
    now = time.time() if now is None else now
    if isinstance(exc, WorkerDiedError):
        cause = Cause.DIED
    elif isinstance(exc, WorkerTimeoutError):
        cause = Cause.HANG if exc.cause == "hang" else Cause.TIMEOUT
    elif isinstance(exc, CollectiveError):
        cause = Cause.COLLECTIVE
    elif isinstance(exc, WorkerError):
        cause = Cause.of(exc.cause) if exc.cause else Cause.EXCEPTION
    elif isinstance(exc, StorageError) and exc.outage:
        # Storage unreachable past the retries (e.g. while restoring): it may come back, so it
        # spends the failure budget like a dead worker instead of ending the run at once.
        # Checkpoint saves never get here: they skip the checkpoint (trainer/checkpointing.py).
        cause = Cause.STORAGE
    elif isinstance(exc, RRLError):
        cause = Cause.ERROR
    else:
        cause = Cause.EXCEPTION
    return Failure(getattr(exc, "role", None), getattr(exc, "rank", None), cause, str(exc)[:500], now)


class Decision(Enum):
    RETRY = "retry"
    RAISE = "raise"


@dataclass
class Verdict:
    decision: Decision
    reason: str


class FailurePolicy:
    """Decides whether a failure is retried, within a per-actor and a per-window budget."""

    def __init__(self, max_restarts: int, max_failures: int, failure_window_s: float,
                 clock: Callable[[], float] = time.time):
        self.max_restarts = max_restarts
        self.max_failures = max_failures
        self.window_s = failure_window_s
        self.clock = clock
        self.restarts: dict[str, int] = {}
        self.recent: deque[float] = deque()
        self.total = 0

    @staticmethod
    def _key(role: str | None, rank: int | None) -> str:
        return f"{role}:{rank}"

    def decide(self, failure: Failure, restarting: Iterable[tuple[str, int]] = ()) -> Verdict:
        """Count ``failure`` and decide, before anything is restarted for it.

        ``restarting`` are the actors (process group, rank) the recovery would have to restart
        (found dead or unresponsive): the verdict is RAISE if one of them has no restart left.
        Nothing is spent on them here; :meth:`record_restarts` does that once they are back."""
        self.total += 1
        now = self.clock()
        self.recent.append(now)
        while self.recent and now - self.recent[0] > self.window_s:
            self.recent.popleft()
        where = f"{failure.role} rank {failure.rank}" if failure.role is not None else "the controller"
        if failure.cause not in RECOVERABLE_CAUSES:
            return Verdict(Decision.RAISE, f"{where} failed with a non-recoverable error ({failure.cause.value}): "
                                           f"{failure.message}")
        over = sorted({k for k in (self._key(g, r) for g, r in restarting)
                       if self.restarts.get(k, 0) >= self.max_restarts})
        if over:
            return Verdict(Decision.RAISE, f"restart budget spent: {', '.join(over)} already restarted "
                                           f"max_restarts={self.max_restarts} times (last failure: {where}, "
                                           f"{failure.cause.value})")
        if len(self.recent) > self.max_failures:
            return Verdict(Decision.RAISE, f"{len(self.recent)} failures within {self.window_s:g}s exceed "
                                           f"max_failures={self.max_failures} (last failure: {where}, "
                                           f"{failure.cause.value})")
        return Verdict(Decision.RETRY, f"{where} {failure.cause.value}: recovering")

    def record_restarts(self, restarted: Iterable[tuple[str, int]]) -> Verdict:
        """Spend one restart per actor that came back in a new process; RAISE past ``max_restarts``
        (an actor Ray restarted that the failure did not name, e.g. one of two killed at once)."""
        for role, rank in restarted:
            k = self._key(role, rank)
            self.restarts[k] = self.restarts.get(k, 0) + 1
        over = sorted(k for k, n in self.restarts.items() if n > self.max_restarts)
        if over:
            return Verdict(Decision.RAISE, f"restart budget spent: {', '.join(over)} restarted more than "
                                           f"max_restarts={self.max_restarts} times")
        return Verdict(Decision.RETRY, "restarts within budget")

    def state_dict(self) -> dict:
        """The budget spent (JSON): restarts per actor, failure times (wall clock) in the window, total."""
        return {"restarts": dict(self.restarts), "recent": list(self.recent), "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        """Take over a saved budget without giving back what this process has spent since.

        A restarted controller gets the budget its checkpoint recorded; a recovery in this process
        restores an older checkpoint but keeps the failures counted after it (per actor the larger
        count, the union of failure times), so rolling back never refills the budget."""
        for k, v in state.get("restarts", {}).items():
            self.restarts[str(k)] = max(self.restarts.get(str(k), 0), int(v))
        self.recent = deque(sorted(set(self.recent) | {float(t) for t in state.get("recent", [])}))
        self.total = max(self.total, int(state.get("total", 0)))


class RecoveryState(Enum):
    RUNNING = "running"
    RECOVERING = "recovering"
    REJOINING = "rejoining"
    RESTORING = "restoring"
    ABORTING = "aborting"
    FAILED = "failed"


S = RecoveryState
ALLOWED: dict[RecoveryState, frozenset[RecoveryState]] = {
    S.RUNNING: frozenset({S.RECOVERING, S.ABORTING}),
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
