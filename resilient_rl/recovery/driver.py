"""Automatic recovery of a run: repair the worker pool, rejoin, restore, replay.

When a step fails (an actor died, a collective broke, a rank stopped answering or advancing,
a call passed its ceiling), :meth:`Recovery.handle` drives the recovery state machine: one handler
per state does that state's work and returns the next state.

1. RECOVERING (:mod:`resilient_rl.recovery.recovering`): the failure, typed where it was raised
   (:class:`~resilient_rl.errors.Cause`), is decided by the :class:`FailurePolicy` *before*
   anything is killed or waited for; then the pool's processes are repaired: unresponsive and
   hung ranks killed, dead ranks handed to warm spares or restarted by Ray.
2. REJOINING: the process groups that lost a member, and the one the failure names, join a new
   generation (survivors drop the broken one), and their roles rebuild their models on it (FSDP2
   modules are bound to their process group). Groups whose members all survived keep their
   process group and models: a dead rollout does not make the actor re-initialise.
3. RESTORING: the run rolls back (:mod:`resilient_rl.recovery.rollback`) to the newest complete
   in-memory snapshot, else the newest committed checkpoint that verifies, else the start: the
   stateful roles, the controller's own state (step, data position, KL coefficient) and the
   rollout's weights together.
4. RUNNING: the lost steps are replayed; the step is a pure function of the restored state, so
   the run ends bit-identical to one without failures.

A failure inside any state is classified like the first and re-enters RECOVERING, where the
policy decides again (failures inside recovery spend the same budget); a failure in a row waits
first, longer with each (:mod:`resilient_rl.recovery.backoff`). Past the budget, or for a
cause no replay can fix: ABORTING -> FAILED with a :class:`RecoveryError` naming the failing role
and rank, the last committed checkpoint untouched.

:class:`Recovery` talks to narrow collaborators only (the pool's recovery interface
:class:`~resilient_rl.runtime.pool.RecoveryPool`, the checkpoint coordinator's
``abandon``/``last_committed``, the roll-back, an event emitter), so the whole protocol runs in
unit tests against a fake pool and a fake clock. Each state is one small class whose ``enter``
does that state's work and returns the next state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

from resilient_rl.errors import (CheckpointFormatError, LeaseError, NoValidCheckpointError, RecoveryError, RRLError,
                                 Preempted, WorkerError)
from resilient_rl.recovery.attempt import Attempt, Context
from resilient_rl.recovery.backoff import Backoff
from resilient_rl.recovery.causes import classify
from resilient_rl.recovery.policy import FailurePolicy
from resilient_rl.recovery.phases import detect_seconds, state_seconds
from resilient_rl.recovery.recovering import Recovering
from resilient_rl.recovery.rollback import AFTER_FAILURE, Point
from resilient_rl.recovery.states import RecoveryState, RecoveryStateMachine
from resilient_rl.runtime.pool import RecoveryPool

logger = logging.getLogger(__name__)
S = RecoveryState


class CheckpointState(Protocol):
    """What recovery needs of the checkpoints: drop a save in flight, name the last commit."""

    last_committed: int | None

    def abandon(self, reason: str = "recovery") -> None: ...


class RollBackAfterFailure(Protocol):
    """What recovery needs of the roll-back (:class:`~resilient_rl.recovery.rollback.RollBack`)."""

    source: str | None  # where the last roll-back went: snapshot, checkpoint or start

    def roll_back_to(self, roles, *points: Point) -> int | None: ...


class Rejoining:
    """REJOINING: the broken process groups join a new generation and rebuild their models."""

    def enter(self, a: Attempt, pool: RecoveryPool) -> S:
        a.rejoin |= self._broken_groups(pool, a)
        groups = sorted(a.rejoin)
        pool.rendezvous(groups)
        pool.init_models(groups, empty=True)  # the restore that follows fills every state
        return S.RESTORING

    @staticmethod
    def _broken_groups(pool: RecoveryPool, a: Attempt) -> set[str]:
        """The process groups to rejoin: those with a restarted member, the one the failure
        names (its collectives may be broken), and those with a member that left its collectives
        (told to, or after a collective of it failed: a sync's failure in one group leaves the
        other's too); every group when the failure names none. The others keep their process
        group and their models (per-group recovery): the restore then rolls their state back in
        place."""
        if a.group is None:
            return set(pool.process_groups())
        left = {group for (group, _), info in pool.workers().items() if getattr(info, "left", False)}
        return {a.group} | {group for group, _ in a.restarted} | left


class Restoring:
    """RESTORING: the run rolls back to the newest snapshot, checkpoint or the start."""

    def __init__(self, rollback: RollBackAfterFailure):
        self.rollback = rollback

    def enter(self, a: Attempt, pool: RecoveryPool) -> S:
        try:
            a.restored = self.rollback.roll_back_to(pool, *a.points)
        except (NoValidCheckpointError, CheckpointFormatError) as exc:
            # Committed steps exist but none may be loaded: starting over would cut the run's
            # history and set its checkpoints aside, so the recovery gives up instead.
            raise RecoveryError(f"recovery found no checkpoint it may restore: {exc}") from exc
        a.source = self.rollback.source
        return S.RUNNING


class Aborting:
    """ABORTING: past the budget or not recoverable; FAILED with the last commit named."""

    def __init__(self, ctx: Context, checkpoints: CheckpointState, sm: RecoveryStateMachine):
        self.ctx, self.checkpoints, self.sm = ctx, checkpoints, sm

    def enter(self, a: Attempt, pool: RecoveryPool) -> S:
        last = self.checkpoints.last_committed
        self.ctx.emit("aborted", reason=a.reason, role=a.failure.role, rank=a.failure.rank, last_committed_step=last)
        self.sm.to(S.FAILED)
        error = type(a.abort_error) if a.abort_error is not None else RecoveryError
        committed = "no checkpoint was committed" if last is None else f"the last committed checkpoint is step {last}"
        raise error(f"giving up: {a.reason}; {committed}")


class Recovery:
    """Runs the recovery protocol on a :class:`~resilient_rl.runtime.pool.RecoveryPool`.

    Args:
        cfg: the ``recovery`` config section.
        checkpoints: the checkpoint coordinator (``abandon``, ``last_committed``).
        rollback: rolls pool and controller back to the first point that exists of the newest
            snapshot, valid checkpoint or the start (``roll_back_to``) and says where it went (``source``).
        emit: ``emit(kind, **fields)`` records an event of the run (``events.jsonl``, metrics); each
            state the recovery enters is a ``recovery_state`` event (fault hooks act on them).
        clock, sleep, wall_clock: monotonic time, sleeping and the time of day, replaced by fakes in tests.
        policy: the failure policy (its budget is part of the controller's checkpointed state);
            by default one from ``cfg`` on ``wall_clock``.
    """

    def __init__(self, cfg, checkpoints: CheckpointState, rollback: RollBackAfterFailure, emit: Callable[..., None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall_clock: Callable[[], float] = time.time, policy: FailurePolicy | None = None):
        self.cfg = cfg
        self.checkpoints = checkpoints
        self.emit = emit
        self.clock, self.wall_clock = clock, wall_clock
        self.policy = policy if policy is not None else FailurePolicy.from_config(cfg, clock=wall_clock)
        self.sm = RecoveryStateMachine(clock=clock)
        self.recoveries = 0
        self.steps_replayed = 0
        self.recovery_seconds = 0.0
        self.backoff = Backoff(cfg.backoff_s, clock, sleep)
        ctx = Context(cfg, self.policy, emit, clock, sleep, self.backoff)
        self.states = {S.RECOVERING: Recovering(ctx), S.REJOINING: Rejoining(), S.RESTORING: Restoring(rollback),
                       S.ABORTING: Aborting(ctx, checkpoints, self.sm)}

    def handle(self, exc: BaseException, failed_step: int, pool: RecoveryPool | None,
               points: tuple[Point, ...] = AFTER_FAILURE) -> None:
        """Recover ``pool`` from ``exc`` raised while running step ``failed_step``, or raise
        RecoveryError. ``pool`` None: the roles run in the controller's own process, which no
        recovery restarts: the failure is reported and the run stops. ``points``: where the run
        rolls back to, the first that exists (a failure while a run resumes: the point it was
        resuming to)."""
        t0 = self.clock()
        detect = detect_seconds(exc)
        attempt = dataclasses.replace(self._attempt(exc, failed_step, pool), points=points)
        self.backoff.failed(failed_step)
        self._report("failure", attempt, step=failed_step)
        logger.warning("step %d failed (%s, %s rank %s): %s", failed_step, attempt.failure.cause.value,
                       attempt.failure.role, attempt.failure.rank, attempt.failure.message)
        self.sm.to(S.RECOVERING)
        first = len(self.sm.history) - 1  # this recovery's transitions, for its phase split
        self.checkpoints.abandon()
        state = S.RECOVERING
        if pool is None:
            attempt.reason = f"the roles run in the controller's own process: {attempt.failure.message}"
            state = S.ABORTING
            self.sm.to(state)
        while state is not S.RUNNING:
            try:
                if pool is not None:
                    pool.interrupt()  # asked to stop (a preemption signal): before the state's calls
                self.emit("recovery_state", state=state.value, failed_step=failed_step)
                following = self.states[state].enter(attempt, pool)
            except (RecoveryError, LeaseError, Preempted):
                raise  # aborted, another controller owns the run now, or asked to stop: recovering would fight it
            except (WorkerError, RRLError, TimeoutError) as again:
                logger.warning("failure during recovery (%s): %s", self.sm.state.value, again)
                self.backoff.failed_again()
                # What the interrupted attempt did and where it rolls back to carry over.
                attempt = dataclasses.replace(self._attempt(again, failed_step, pool), restarted=attempt.restarted,
                                              rejoin=attempt.rejoin, points=attempt.points)
                self._report("failure_during_recovery", attempt, state=self.sm.state.value)
                following = S.RECOVERING
            self.sm.to(following)
            state = following
        end = self.clock()
        duration = end - t0
        phases = {"detect": detect, **state_seconds(self.sm.history[first:], end)}
        replayed = max(0, failed_step - 1 - attempt.restored)
        self.recoveries += 1
        self.steps_replayed += replayed
        self.recovery_seconds += duration
        self.emit("recovered", failed_step=failed_step, restored_step=attempt.restored, steps_replayed=replayed,
                  duration_s=duration, restarted=[list(k) for k in attempt.restarted], rejoined=sorted(attempt.rejoin),
                  generation=pool.generation, source=attempt.source, phases=phases)
        logger.warning("recovered in %.1fs: restored step %d, replaying %d step(s)", duration, attempt.restored,
                       replayed)

    def _attempt(self, exc: BaseException, failed_step: int, pool: RecoveryPool | None) -> Attempt:
        failure = classify(exc, now=self.wall_clock())
        group, role = pool.locate(failure.role) if pool is not None else (None, None)
        if role is not None:
            failure = dataclasses.replace(failure, role=role)
        return Attempt(failed_step, failure, exc, group=group)

    def _report(self, kind: str, a: Attempt, **fields: Any) -> None:
        f = a.failure
        self.emit(kind, role=f.role, rank=f.rank, group=a.group, cause=f.cause.value, message=f.message, **fields)
