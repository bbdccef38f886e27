"""What failed and why: a :class:`Failure` built from the error that reached the controller.

The :class:`~resilient_rl.errors.Cause` is named where a failure is raised (a worker error carries
it); :func:`classify` adds who and when, and types the errors that are not worker errors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from resilient_rl.errors import Cause, RRLError, StorageError, WorkerError

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
    """A :class:`Failure` from an exception raised while driving the workers.

    A worker error carries its cause from where it was raised (:attr:`WorkerError.cause`); other
    errors are classified by type here, where they reach the controller."""
    now = time.time() if now is None else now
    if isinstance(exc, WorkerError):
        cause = exc.cause
    elif isinstance(exc, StorageError) and exc.outage:
        # Storage unreachable past the retries (e.g. while restoring): it may come back, so it
        # spends the failure budget like a dead worker instead of ending the run at once.
        # Checkpoint saves never get here: they skip the checkpoint (checkpoint/coordinator.py).
        cause = Cause.STORAGE
    elif isinstance(exc, RRLError):
        cause = Cause.ERROR
    else:
        cause = Cause.EXCEPTION
    role, rank = (exc.role, exc.rank) if isinstance(exc, WorkerError) else (None, None)
    return Failure(role, rank, cause, str(exc)[:500], now)
