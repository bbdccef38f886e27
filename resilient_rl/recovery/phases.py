"""The phases of one recovery, from the recovery state machine's timestamped history.

``detect`` runs from the failure to recovery starting: from when the controller learnt of it
(:attr:`~resilient_rl.errors.WorkerError.raised_at`), and for a hung worker from the start of the
hang (its ``stalled_s`` before it was judged hung). ``restart``, ``rejoin`` and ``restore`` are the
time spent in the RECOVERING, REJOINING and RESTORING states (a failure inside recovery re-enters
RECOVERING: every visit counts). ``replay`` happens after recovery, while the lost steps are
trained again; the telemetry times it (:mod:`resilient_rl.telemetry.training_time`).
"""

from __future__ import annotations

import time
from typing import Sequence

from resilient_rl.errors import WorkerError, WorkerTimeoutError
from resilient_rl.recovery.states import RecoveryState

#: The recovery phase each state's time is reported under.
STATE_PHASES = {RecoveryState.RECOVERING: "restart", RecoveryState.REJOINING: "rejoin",
                RecoveryState.RESTORING: "restore"}


def detect_seconds(exc: BaseException, now: float | None = None) -> float:
    """Seconds from the failure behind ``exc`` to ``now`` (monotonic; the start of recovery)."""
    now = time.monotonic() if now is None else now
    if not isinstance(exc, WorkerError):  # raised in the controller itself: detected as it happened
        return 0.0
    waited = max(0.0, now - exc.raised_at)
    stalled = exc.stalled_s if isinstance(exc, WorkerTimeoutError) else None
    return waited + (float(stalled) if stalled is not None and stalled > 0 else 0.0)


def state_seconds(history: Sequence[tuple[float, RecoveryState, RecoveryState]], end: float) -> dict[str, float]:
    """Seconds per phase in ``history`` (entries ``(time, from, to)`` of one recovery), the last
    state lasting until ``end``."""
    seconds = {phase: 0.0 for phase in STATE_PHASES.values()}
    times = [t for t, _, _ in history[1:]] + [end]
    for (t, _, entered), left in zip(history, times):
        phase = STATE_PHASES.get(entered)
        if phase is not None:
            seconds[phase] += max(0.0, left - t)
    return seconds
