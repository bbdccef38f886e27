"""The failure policy: RETRY or RAISE, decided before anything is acted on.

Pure (no Ray calls), so the decisions are unit-tested without a cluster. :class:`FailurePolicy`
maps a failure and the counters to RETRY or RAISE, with a restart budget per worker
(``max_restarts``) and one for the job (``max_failures``), both counted over the last
``failure_window_s``. Errors that replaying cannot fix (a bug raising in user code, a bad config)
are RAISE at once.

Both budgets are windows, not lifetimes: a run of a week whose rank fails once a day is healthy,
and a budget that never refilled would end it on the fourth day. A rank that crashes in a loop
spends its budget within the window. Ray's own restart count of an actor cannot refill, so the
actors are created with unlimited restarts (:mod:`resilient_rl.runtime.pool.groups`) and this
policy alone decides.
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
        self.restart_times: dict[str, list[float]] = {}  # per worker, when each restart was spent
        self.recent: deque[float] = deque()
        self.total = 0

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts spent per worker within the window (workers with none left out)."""
        counts = {k: len(self._in_window(k)) for k in self.restart_times}
        return {k: n for k, n in counts.items() if n}

    def _in_window(self, key: str) -> list[float]:
        now = self.clock()
        return [t for t in self.restart_times.get(key, ()) if now - t <= self.window_s]

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
        spent = self.restarts
        over = sorted({k for k in (self._key(g, r) for g, r in restarting) if spent.get(k, 0) >= self.max_restarts})
        if over:
            return Verdict(Decision.RAISE, f"restart budget spent: {', '.join(over)} already restarted "
                                           f"max_restarts={self.max_restarts} times within "
                                           f"failure_window_s={self.window_s:g}s (last failure: {where}, "
                                           f"{failure.cause.value})")
        if len(self.recent) > self.max_failures:
            return Verdict(Decision.RAISE, f"{len(self.recent)} failures within {self.window_s:g}s exceed "
                                           f"max_failures={self.max_failures} (last failure: {where}, "
                                           f"{failure.cause.value})")
        return Verdict(Decision.RETRY, f"{where} {failure.cause.value}: recovering")

    def record_restarts(self, restarted: Iterable[tuple[str, int]]) -> Verdict:
        """Spend one restart per actor that came back in a new process; RAISE past ``max_restarts``
        (an actor Ray restarted that the failure did not name, e.g. one of two killed at once)."""
        now = self.clock()
        for role, rank in restarted:
            k = self._key(role, rank)
            self.restart_times[k] = self._in_window(k) + [now]
        over = sorted(k for k, n in self.restarts.items() if n > self.max_restarts)
        if over:
            return Verdict(Decision.RAISE, f"restart budget spent: {', '.join(over)} restarted more than "
                                           f"max_restarts={self.max_restarts} times within "
                                           f"failure_window_s={self.window_s:g}s")
        return Verdict(Decision.RETRY, "restarts within budget")

    def state_dict(self) -> dict:
        """The budget spent (JSON): restart times per worker and failure times (wall clock) in
        the window, the total of failures."""
        return {"restart_times": {k: self._in_window(k) for k in self.restarts}, "recent": list(self.recent),
                "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        """Take over a saved budget without giving back what this process has spent since.

        A restarted controller gets the budget its checkpoint recorded; a recovery in this process
        restores an older checkpoint but keeps the failures counted after it (the union of the
        restart and failure times), so rolling back never refills the budget. A budget saved as
        counts (older checkpoints) is taken as spent now."""
        now = self.clock()
        for k, v in state.get("restart_times", {}).items():
            self.restart_times[str(k)] = sorted(set(self.restart_times.get(str(k), [])) | {float(t) for t in v})
        for k, n in state.get("restarts", {}).items():
            if len(self.restart_times.get(str(k), [])) < int(n):
                self.restart_times[str(k)] = [now] * int(n)
        self.recent = deque(sorted(set(self.recent) | {float(t) for t in state.get("recent", [])}))
        self.total = max(self.total, int(state.get("total", 0)))
