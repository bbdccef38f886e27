"""Automatic recovery of a run: repair the worker pool, rejoin, restore, replay.

When a step fails (an actor died, a collective broke, a rank stopped answering or advancing,
a call passed its ceiling), :meth:`Recovery.handle` drives the recovery state machine: one handler
per state does that state's work and returns the next state.

1. RECOVERING: the failure is classified once (a :class:`~resilient_rl.controller.recovery.Cause`);
   every rank is probed through its health concurrency group; the :class:`FailurePolicy` decides
   *before* anything is killed or waited for, knowing which ranks would need a restart. Then a
   rank that does not answer (SIGSTOPped) is SIGKILLed, and so is the rank the failure names as
   not advancing (it still answers the probe); survivors still inside a call are waited for (a
   collective error ends it at once when a peer died) and killed if they stop advancing; then
   each dead rank is handed to a ready warm spare of its group where there is one
   (``recovery.spares``, :mod:`resilient_rl.controller.spares`), and the protocol waits until
   Ray has restarted every other dead actor (``max_restarts``) and all answer.
   Survivors keep their processes. Each restart spends the restarted actor's budget.
2. REJOINING: the process groups that lost a member, and the one the failure names, join a new
   generation (survivors drop the broken one), and their roles rebuild their models on it (FSDP2
   modules are bound to their process group). Groups whose members all survived keep their
   process group and models: a dead rollout does not make the actor re-initialise.
3. RESTORING: the newest complete in-memory snapshot (:mod:`resilient_rl.trainer.snapshots`)
   or else the newest committed checkpoint that verifies is loaded into actor and critic, the
   controller's own state (step, data position, KL coefficient) rolls back with it, and the
   rollout gets the restored weights.
4. RUNNING: the lost steps are replayed; the step is a pure function of the restored state, so
   the run ends bit-identical to one without failures.

A failure inside any state is classified like the first and re-enters RECOVERING, where the
policy decides again (failures inside recovery spend the same budget). Past the budget, or for a
cause no replay can fix: ABORTING -> FAILED with a :class:`RecoveryError` naming the failing role
and rank, the last committed checkpoint untouched.

:class:`Recovery` talks to narrow collaborators only (the worker pool, the checkpoint
coordinator's ``abandon``/``last_committed``, a restore callable, an event emitter), so the whole
protocol runs in unit tests against a fake pool and a fake clock.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

from resilient_rl.controller.recovery import (Cause, Decision, Failure, FailurePolicy, RecoveryState,
                                              RecoveryStateMachine, classify)
from resilient_rl.errors import LeaseError, RecoveryError, RRLError, WorkerError, WorkerTimeoutError
from resilient_rl.trainer.pool import ProcessKey, WorkerPool, primary_role
from resilient_rl.trainer.recovery_phases import detect_seconds, state_seconds

logger = logging.getLogger(__name__)
S = RecoveryState


class CheckpointState(Protocol):
    """What recovery needs of the checkpoints: drop a save in flight, name the last commit."""

    last_committed: int | None

    def abandon(self, reason: str = "recovery") -> None: ...


@dataclasses.dataclass
class _Attempt:
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


class Recovery:
    """Runs the recovery protocol against a :class:`~resilient_rl.trainer.pool.WorkerPool`.

    Args:
        cfg: the ``recovery`` config section.
        pool: returns the run's worker pool (it exists from the first step on).
        checkpoints: the checkpoint coordinator (``abandon``, ``last_committed``).
        restore: rolls pool and controller back to the newest valid checkpoint (or the start) and
            returns its step.
        emit: ``emit(kind, **fields)`` records an event of the run (``events.jsonl``, metrics).
        on_state: called with each state entered after RECOVERING (fault hooks).
        restore_source: after ``restore``, where the state came from (``snapshot``, ``checkpoint``, ``start``).
        clock, sleep: monotonic time and sleeping, replaced by fakes in tests.
    """

    def __init__(self, cfg, pool: Callable[[], WorkerPool], checkpoints: CheckpointState,
                 restore: Callable[[], int], emit: Callable[..., None],
                 on_state: Callable[[RecoveryState], None] = lambda state: None,
                 restore_source: Callable[[], str | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall_clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.pool = pool
        self.checkpoints = checkpoints
        self.restore = restore
        self.emit = emit
        self.on_state = on_state
        self.restore_source = restore_source
        self.clock, self.sleep, self.wall_clock = clock, sleep, wall_clock
        self.policy = FailurePolicy(cfg.max_restarts, cfg.max_failures, cfg.failure_window_s, clock=wall_clock)
        self.sm = RecoveryStateMachine(clock=clock)
        self.recoveries = 0
        self.steps_replayed = 0
        self.recovery_seconds = 0.0
        self._handlers: dict[RecoveryState, Callable[[_Attempt], RecoveryState]] = {
            S.RECOVERING: self._recovering, S.REJOINING: self._rejoining, S.RESTORING: self._restoring,
            S.ABORTING: self._aborting}

    # ------------------------------------------------------------------ protocol
    def handle(self, exc: BaseException, failed_step: int) -> None:
        """Recover from ``exc`` raised while running step ``failed_step``, or raise RecoveryError."""
        t0 = self.clock()
        detect = detect_seconds(exc)
        attempt = self._attempt(exc, failed_step)
        self._report("failure", attempt, step=failed_step)
        logger.warning("step %d failed (%s, %s rank %s): %s", failed_step, attempt.failure.cause.value,
                       attempt.failure.role, attempt.failure.rank, attempt.failure.message)
        self.sm.to(S.RECOVERING)
        first = len(self.sm.history) - 1  # this recovery's transitions, for its phase split
        self.checkpoints.abandon()
        state = S.RECOVERING
        while state is not S.RUNNING:
            try:
                following = self._handlers[state](attempt)
            except (RecoveryError, LeaseError):
                raise  # aborted, or another controller owns the run now: recovering would fight it
            except (WorkerError, RRLError, TimeoutError) as again:
                logger.warning("failure during recovery (%s): %s", self.sm.state.value, again)
                attempt = dataclasses.replace(self._attempt(again, failed_step), restarted=attempt.restarted,
                                              rejoin=attempt.rejoin)
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
                  duration_s=duration, restarted=[list(k) for k in attempt.restarted],
                  generation=self.pool().generation, source=attempt.source, phases=phases)
        logger.warning("recovered in %.1fs: restored step %d, replaying %d step(s)", duration, attempt.restored,
                       replayed)

    def _attempt(self, exc: BaseException, failed_step: int) -> _Attempt:
        failure = classify(exc, now=self.wall_clock())
        group, role = self.pool().locate(failure.role)
        if role is not None:
            failure = dataclasses.replace(failure, role=role)
        return _Attempt(failed_step, failure, exc, group=group)

    def _report(self, kind: str, a: _Attempt, **fields: Any) -> None:
        f = a.failure
        self.emit(kind, role=f.role, rank=f.rank, group=a.group, cause=f.cause.value, message=f.message, **fields)

    # ------------------------------------------------------------------ states
    def _recovering(self, a: _Attempt) -> RecoveryState:
        if not self.cfg.enabled:
            a.reason = f"recovery is disabled: {a.failure.message}"
            return S.ABORTING
        pool = self.pool()
        known = pool.workers()
        unresponsive, dead, replaced = self._probe(pool, known)
        lost = dead + replaced
        hung = self._hung_rank(pool, a, known)
        if a.failure.cause is Cause.EXCEPTION and (lost or unresponsive):
            # A survivor's error raced ahead of the death that caused it: the death is the failure.
            group, rank = (lost or unresponsive)[0]
            a.failure = dataclasses.replace(a.failure, cause=Cause.DIED, role=primary_role(pool.roles_of(group)),
                                            rank=rank)
            a.group = group
        to_restart = sorted(set(unresponsive) | set(lost) | ({hung} if hung else set()))
        verdict = self.policy.decide(a.failure, restarting=[self._budget_key(pool, k) for k in to_restart])
        if verdict.decision is Decision.RAISE:
            a.reason = verdict.reason
            return S.ABORTING
        killed: set[ProcessKey] = set()
        for key in unresponsive:
            self._kill(pool, key, known, "kill_unresponsive", killed)
        if hung is not None and hung not in killed:
            self._kill(pool, hung, known, "kill_hung", killed, reason=a.failure.message[:300])
        # Spares first: the drain then probes them (idle, answering) rather than dead processes.
        adopted = self._adopt_spares(pool, set(dead) | killed)
        self._drain(pool, known, killed)
        self._adopt_spares(pool, killed - adopted)  # survivors the drain found stalled
        restarted = self._wait_restarted(pool, known, a.failure.cause)
        a.restarted += restarted
        verdict = self.policy.record_restarts([self._budget_key(pool, k) for k in restarted])
        if verdict.decision is Decision.RAISE:
            a.reason = verdict.reason
            return S.ABORTING
        return S.REJOINING

    def _rejoining(self, a: _Attempt) -> RecoveryState:
        self.on_state(S.REJOINING)
        pool = self.pool()
        a.rejoin |= self._broken_groups(pool, a)
        groups = sorted(a.rejoin)
        pool.rendezvous(groups)
        pool.init_models(groups, empty=True)  # the restore that follows fills every state
        return S.RESTORING

    def _restoring(self, a: _Attempt) -> RecoveryState:
        self.on_state(S.RESTORING)
        a.restored = self.restore()
        a.source = self.restore_source()
        return S.RUNNING

    @staticmethod
    def _broken_groups(pool: WorkerPool, a: _Attempt) -> set[str]:
        """The process groups to rejoin: those with a restarted member and the one the failure
        names (its collectives may be broken); every group when the failure names none. The
        others keep their process group and their models (per-group recovery): the restore
        then rolls their state back in place."""
        if a.group is None:
            return set(pool.process_groups())
        return {a.group} | {group for group, _ in a.restarted}

    def _aborting(self, a: _Attempt) -> RecoveryState:
        last = self.checkpoints.last_committed
        self.emit("aborted", reason=a.reason, role=a.failure.role, rank=a.failure.rank, last_committed_step=last)
        self.sm.to(S.FAILED)
        raise RecoveryError(f"giving up: {a.reason}; the last committed checkpoint is step {last}")

    # ------------------------------------------------------------------ repair
    @staticmethod
    def _budget_key(pool: WorkerPool, key: ProcessKey) -> tuple[str, int]:
        """(role, rank): the name a process's restart budget is kept under, the same for every
        controller of the run (process-group names carry a per-controller instance id)."""
        return primary_role(pool.roles_of(key[0])) or key[0], key[1]

    def _probe(self, pool: WorkerPool, known: dict) -> tuple[list[ProcessKey], list[ProcessKey], list[ProcessKey]]:
        """(unresponsive, dead, replaced): known ranks that do not answer the health probe
        (stopped, hung outside a call), ranks whose process died, and ranks whose process was
        already replaced (restarted)."""
        unresponsive, dead, replaced = [], [], []
        for group in pool.process_groups():
            for rank, info in pool.probe(group, timeout_s=self.cfg.health_timeout_s).items():
                key = (group, rank)
                if key not in known:
                    continue
                if info is None:
                    unresponsive.append(key)
                elif isinstance(info, BaseException):
                    dead.append(key)
                elif info.pid != known[key].pid:
                    replaced.append(key)
        return unresponsive, dead, replaced

    def _hung_rank(self, pool: WorkerPool, a: _Attempt, known: dict) -> ProcessKey | None:
        """The process ``a``'s error names as not advancing, if it is still the one known."""
        exc = a.exc
        if not isinstance(exc, WorkerTimeoutError) or exc.cause != "hang" or exc.rank is None or a.group is None:
            return None
        info = known.get((a.group, exc.rank))
        if info is None or (exc.pid is not None and info.pid != exc.pid):
            return None
        return a.group, exc.rank

    def _kill(self, pool: WorkerPool, key: ProcessKey, known: dict, kind: str, killed: set, **extra: Any) -> None:
        info = known[key]
        self.emit(kind, group=key[0], rank=key[1], pid=info.pid, node=info.node_id, **extra)
        pool.kill(key)
        killed.add(key)

    def _adopt_spares(self, pool: WorkerPool, dead: set[ProcessKey]) -> set[ProcessKey]:
        """Hand the ``dead`` ranks to warm spares where their groups have ready ones."""
        adopted = set(pool.adopt_spares(sorted(dead))) if dead else set()
        for group, rank in sorted(adopted):
            self.emit("spare_adopted", group=group, rank=rank, role=primary_role(pool.roles_of(group)))
        return adopted

    def _drain(self, pool: WorkerPool, known: dict, killed: set) -> None:
        """Wait until no survivor is inside a call, so the rendezvous does not queue behind one.

        A survivor whose peer died normally leaves its call at once with a collective error; one
        that stays inside a call without advancing for ``hang_timeout_s`` is killed too."""
        deadline = self.clock() + self.cfg.restart_timeout_s
        while self.clock() < deadline:
            busy = 0
            for group in pool.process_groups():
                for rank, info in pool.probe(group, timeout_s=self.cfg.health_timeout_s, during_call=True).items():
                    key = (group, rank)
                    if key in killed or key not in known or isinstance(info, BaseException):
                        continue
                    if info is None:
                        self._kill(pool, key, known, "kill_unresponsive", killed)
                    elif info.call is not None and info.pid == known[key].pid:
                        if (info.progress_age_s or 0.0) > self.cfg.hang_timeout_s:
                            self._kill(pool, key, known, "kill_hung", killed,
                                       reason=f"inside {info.call!r} without progress for {info.progress_age_s:.1f}s")
                        else:
                            busy += 1
            if not busy:
                return
            self.sleep(0.2)

    def _wait_restarted(self, pool: WorkerPool, known: dict, cause: Cause) -> list[ProcessKey]:
        """Wait until every rank answers; the ranks that came back in a new process."""
        restarted = []
        for group in pool.process_groups():
            for rank, info in enumerate(pool.wait_alive(group, self.cfg.restart_timeout_s)):
                old = known.get((group, rank))
                if old is None or old.pid != info.pid:
                    restarted.append((group, rank))
                    self.emit("worker_restarted", group=group, rank=rank, pid=info.pid, node=info.node_id,
                              role=primary_role(pool.roles_of(group)), cause=cause.value)
        pool.refresh_workers()
        return restarted
