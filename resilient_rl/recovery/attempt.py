"""One recovery attempt, and what every recovery state shares."""

from __future__ import annotations

import dataclasses
from typing import Callable

from resilient_rl.errors import RecoveryError
from resilient_rl.recovery.backoff import Backoff
from resilient_rl.recovery.causes import Failure
from resilient_rl.recovery.policy import FailurePolicy
from resilient_rl.recovery.rollback import AFTER_FAILURE
from resilient_rl.runtime.pool import ProcessKey


@dataclasses.dataclass
class Attempt:
    """One recovery: the failure being handled and what the states found and did."""

    failed_step: int
    failure: Failure
    exc: BaseException
    group: str | None = None  # the process group the failure names, where known
    restarted: list[ProcessKey] = dataclasses.field(default_factory=list)
    restored: int = 0
    rejoin: set[str] = dataclasses.field(default_factory=set)  # process groups to rejoin and rebuild
    source: str | None = None  # where the restored state came from (snapshot, checkpoint, start)
    reason: str = ""
    abort_error: RecoveryError | None = None  # the error to stop with, where more precise than RecoveryError
    points: tuple = AFTER_FAILURE  # where RESTORING rolls back to, the first that exists


@dataclasses.dataclass
class Context:
    """What the states share: the ``recovery`` config, the policy, the event emitter, the clocks,
    the count of failures in a row."""

    cfg: object
    policy: FailurePolicy
    emit: Callable[..., None]
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    backoff: Backoff
