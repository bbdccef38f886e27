"""The failure policy: RETRY or RAISE, decided before anything is acted on.

Pure (no Ray calls), so the decisions are unit-tested without a cluster. :class:`FailurePolicy`
maps a failure and the counters to RETRY or RAISE, with a restart budget per actor
(``max_restarts``) and per time window for the job (``max_failures`` in ``failure_window_s``).
Errors that replaying cannot fix (a bug raising in user code, a bad config) are RAISE at once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable

from resilient_rl.recovery.causes import RECOVERABLE_CAUSES, Failure


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

    @classmethod
    def from_config(cls, cfg, clock: Callable[[], float] = time.time) -> "FailurePolicy":
        """The policy of the ``recovery`` config section ``cfg``."""
        return cls(cfg.max_restarts, cfg.max_failures, cfg.failure_window_s, clock=clock)

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
