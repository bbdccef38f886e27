"""Automatic recovery of a run: repair the worker groups, rejoin, restore, replay.

When a step fails (an actor died, a collective broke, a rank stopped answering or advancing,
a call passed its ceiling), the controller walks the recovery state machine:

1. RECOVERING: probe every rank through its health concurrency group; a rank that does not
   answer (SIGSTOPped) is SIGKILLed, and so is the rank the failure names as not advancing
   (it still answers the probe); survivors still inside a call are waited for (a collective
   error ends it at once when a peer died) and killed if they stop advancing; then wait until
   Ray has restarted every dead actor (``max_restarts``) and all answer. Survivors keep their
   processes.
2. REJOINING: every process group joins a new generation (survivors drop the broken one), and
   every role rebuilds its model on it (FSDP2 modules are bound to their process group).
3. RESTORING: the newest committed checkpoint that verifies is loaded into actor and critic, the
   controller's own state (step, data position, KL coefficient) rolls back with it, and the
   rollout gets the restored weights.
4. RUNNING: the lost steps are replayed; the step is a pure function of the restored state, so
   the run ends bit-identical to one without failures.

A failure during recovery re-enters RECOVERING. The :class:`FailurePolicy` budget ends it:
ABORTING -> FAILED with a :class:`RecoveryError` naming the failing role and rank, the last
committed checkpoint untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from resilient_rl.controller.recovery import (Decision, FailurePolicy, RecoveryState, RecoveryStateMachine,
                                              classify)
from resilient_rl.errors import LeaseError, RecoveryError, RRLError, WorkerError, WorkerTimeoutError

logger = logging.getLogger(__name__)
S = RecoveryState


class Recovery:
    """Runs the recovery protocol for a :class:`~resilient_rl.trainer.ppo.PPOTrainer`."""

    def __init__(self, trainer, metrics=None):
        c = trainer.cfg.recovery
        self.trainer = trainer
        self.cfg = c
        self.metrics = metrics
        self.policy = FailurePolicy(c.max_restarts, c.max_failures, c.failure_window_s)
        self.sm = RecoveryStateMachine()
        self.recoveries = 0
        self.steps_replayed = 0
        self.recovery_seconds = 0.0

    # ------------------------------------------------------------------ repair
    def _actor_groups(self):
        return self.trainer.roles.distinct_groups()

    def _repair(self, cause: str = "died", exc: BaseException | None = None) -> list[tuple[str, int]]:
        """Kill hung ranks, let survivors leave their calls, wait for Ray to restart the dead.

        Killed: ranks that do not answer the health probe (stopped), the rank ``exc`` names as
        not advancing (it answers the probe, so the probe alone would spare it), and survivors
        that stay inside a call without advancing for ``hang_timeout_s``. Returns the restarted
        (group, rank)."""
        known = self.trainer.roles.known_workers
        killed: set[tuple[str, int]] = set()
        for g in self._actor_groups():
            probe = g.probe(timeout_s=self.cfg.health_timeout_s)
            for rank, info in probe.items():
                if info is None and (g.name_prefix, rank) in known:
                    self._kill(g, rank, "kill_unresponsive", killed)
        hung = self._hung_rank(exc)
        if hung is not None and hung not in killed:
            g, rank = hung
            self._kill(g, rank, "kill_hung", killed, reason=str(exc)[:300])
        self._drain(killed)
        restarted = []
        for g in self._actor_groups():
            infos = g.wait_alive(self.cfg.restart_timeout_s)
            for rank, info in enumerate(infos):
                old = known.get((g.name_prefix, rank))
                if old is None or old[0] != info.pid:
                    restarted.append((g.name_prefix, rank))
                    self.trainer.run_dir.event("worker_restarted", group=g.name_prefix, rank=rank, pid=info.pid,
                                               node=info.node_id)
                    if self.metrics is not None:
                        self.metrics.record_restart(g.name_prefix, rank, cause)
        self.trainer.roles.refresh_workers()
        return restarted

    def _kill(self, g, rank: int, event: str, killed: set, **extra) -> None:
        pid, node = self.trainer.roles.known_workers[(g.name_prefix, rank)]
        self.trainer.run_dir.event(event, group=g.name_prefix, rank=rank, pid=pid, node=node, **extra)
        g.kill_rank(rank, pid, node)
        killed.add((g.name_prefix, rank))

    def _hung_rank(self, exc: BaseException | None):
        """(process group, rank) that ``exc`` names as hung (cause "hang"), if its process is the one known."""
        if not isinstance(exc, WorkerTimeoutError) or exc.cause != "hang" or exc.rank is None:
            return None
        roles = self.trainer.roles
        named = [g for g in list(getattr(roles, "groups", {}).values()) + self._actor_groups()
                 if g.name_prefix == exc.role]
        for g in self._actor_groups():
            if named and g.workers is named[0].workers:
                known = roles.known_workers.get((g.name_prefix, exc.rank))
                if known is not None and (exc.pid is None or known[0] == exc.pid):
                    return g, exc.rank
        return None

    def _drain(self, killed: set) -> None:
        """Wait until no survivor is inside a call, so the rendezvous does not queue behind one.

        A survivor whose peer died normally leaves its call at once with a collective error; one
        that stays inside a call without advancing for ``hang_timeout_s`` is killed too."""
        deadline = time.monotonic() + self.cfg.restart_timeout_s
        while time.monotonic() < deadline:
            busy = 0
            for g in self._actor_groups():
                if not g._has_health_group():  # its probe would queue behind the call itself
                    continue
                for rank, info in g.probe(timeout_s=self.cfg.health_timeout_s).items():
                    key = (g.name_prefix, rank)
                    if key in killed or key not in self.trainer.roles.known_workers:
                        continue
                    if info is None:
                        self._kill(g, rank, "kill_unresponsive", killed)
                    elif getattr(info, "call", None) is not None and info.pid == self.trainer.roles.known_workers[key][0]:
                        if (info.progress_age_s or 0.0) > self.cfg.hang_timeout_s:
                            self._kill(g, rank, "kill_hung", killed,
                                       reason=f"inside {info.call!r} without progress for {info.progress_age_s:.1f}s")
                        else:
                            busy += 1
            if not busy:
                return
            time.sleep(0.2)

    # ------------------------------------------------------------------ protocol
    def handle(self, exc: BaseException, failed_step: int) -> None:
        """Recover from ``exc`` raised while running step ``failed_step``, or raise RecoveryError."""
        t0 = time.monotonic()
        failure = classify(exc)
        self.trainer.run_dir.event("failure", step=failed_step, role=failure.role, rank=failure.rank,
                                   cause=failure.cause, message=failure.message)
        if self.metrics is not None:
            self.metrics.record_failure(failure.cause, role=failure.role, rank=failure.rank)
        logger.warning("step %d failed (%s, %s rank %s): %s", failed_step, failure.cause, failure.role, failure.rank,
                       failure.message)
        self.sm.to(S.RECOVERING)
        self.trainer.ckpt.abandon()
        while True:
            try:
                restarted = self._repair(failure.cause, exc) if self.cfg.enabled else []
                if restarted and failure.cause == "exception":
                    # A survivor's error raced ahead of the death that caused it: the death is the failure.
                    failure = dataclasses.replace(failure, cause="died", role=restarted[0][0], rank=restarted[0][1])
                verdict = self.policy.decide(failure, restarted)
                if not self.cfg.enabled or verdict.decision is Decision.RAISE:
                    self._abort(verdict.reason if self.cfg.enabled else f"recovery is disabled: {failure.message}",
                                failure)
                self.sm.to(S.REJOINING)
                self.trainer.fire("on_recovery_state", S.REJOINING)
                self.trainer.roles.rendezvous()
                self.trainer.roles.init_models()
                self.sm.to(S.RESTORING)
                self.trainer.fire("on_recovery_state", S.RESTORING)
                restored = self.trainer.restore_after_failure()
                self.sm.to(S.RUNNING)
                break
            except (RecoveryError, LeaseError):
                raise  # another controller owns the run now: recovering would fight it
            except (WorkerError, RRLError, TimeoutError) as again:
                failure = classify(again)
                exc = again
                self.trainer.run_dir.event("failure_during_recovery", state=self.sm.state.value, role=failure.role,
                                           rank=failure.rank, cause=failure.cause, message=failure.message)
                logger.warning("failure during recovery (%s): %s", self.sm.state.value, failure.message)
                if self.sm.state is not S.RECOVERING:
                    self.sm.to(S.RECOVERING)
                # Failures inside recovery spend the same budget: a worker that never comes back
                # ends the run instead of looping.
                verdict = self.policy.decide(failure)
                if verdict.decision is Decision.RAISE:
                    self._abort(verdict.reason, failure)
        duration = time.monotonic() - t0
        replayed = max(0, failed_step - 1 - restored)
        self.recoveries += 1
        self.steps_replayed += replayed
        self.recovery_seconds += duration
        self.trainer.run_dir.event("recovered", failed_step=failed_step, restored_step=restored,
                                   steps_replayed=replayed, duration_s=duration, restarted=restarted,
                                   generation=self.trainer.roles.generation)
        if self.metrics is not None:
            self.metrics.record_recovery(duration, replayed)
        logger.warning("recovered in %.1fs: restored step %d, replaying %d step(s)", duration, restored, replayed)

    def _abort(self, reason: str, failure) -> None:
        self.sm.to(S.ABORTING)
        last = self.trainer.ckpt.last_committed
        self.trainer.run_dir.event("aborted", reason=reason, role=failure.role, rank=failure.rank,
                                   last_committed_step=last)
        self.sm.to(S.FAILED)
        raise RecoveryError(f"giving up: {reason}; the last committed checkpoint is step {last}")
