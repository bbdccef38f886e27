"""RECOVERING: the failure is decided, then the pool's processes are repaired.

Every rank is probed through its health concurrency group; the :class:`FailurePolicy` decides
*before* anything is killed or waited for, knowing which ranks would need a restart. Then a rank
that does not answer (SIGSTOPped) is SIGKILLed, and so is the rank the failure names as not
advancing (it still answers the probe); survivors of the failed ranks' process groups still
inside a call, and those of another group inside a collective that spans a failed one (a weight
sync), are told to leave their collectives (the call then ends at once with a collective error,
see :mod:`resilient_rl.runtime.leave_collective`), waited for, and killed if they stop
advancing; each dead
rank is handed to a ready warm spare of its group where there is one (``recovery.spares``), and
the state waits until Ray has restarted every other dead actor (``max_restarts``) and all answer.
Survivors keep their processes. Each restart spends the restarted actor's budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from resilient_rl.errors import Cause, NoCapacityError, WorkerTimeoutError
from resilient_rl.recovery.attempt import Attempt, Context
from resilient_rl.recovery.causes import RECOVERABLE_CAUSES
from resilient_rl.recovery.policy import Decision
from resilient_rl.recovery.states import RecoveryState as S
from resilient_rl.runtime.pool import ProcessKey, RecoveryPool


class Recovering:
    """The RECOVERING state: decide, then repair the pool (kill, hand to spares, wait for restarts)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def enter(self, a: Attempt, pool: RecoveryPool) -> S:
        ctx = self.ctx
        if not ctx.cfg.enabled:
            a.reason = f"recovery is disabled: {a.failure.message}"
            return S.ABORTING
        if a.failure.cause in RECOVERABLE_CAUSES and ctx.backoff.seconds() > 0:
            ctx.emit("recovery_backoff", in_a_row=ctx.backoff.in_a_row, wait_s=ctx.backoff.seconds())
            ctx.backoff.wait(pool.interrupt)
        known = pool.workers()
        unresponsive, dead, replaced = self._probe(pool, known)
        pool.interrupt()  # a signal that took the workers down may land during the probe
        lost = dead + replaced
        hung = self._hung_rank(a, known)
        if a.failure.cause is Cause.EXCEPTION and (lost or unresponsive):
            # A survivor's error raced ahead of the death that caused it: the death is the failure.
            group, rank = (lost or unresponsive)[0]
            a.failure = dataclasses.replace(a.failure, cause=Cause.DIED, role=pool.roles_of(group)[0],
                                            rank=rank)
            a.group = group
        to_restart = sorted(set(unresponsive) | set(lost) | ({hung} if hung else set()))
        verdict = ctx.policy.decide(a.failure, restarting=[budget_key(pool, k) for k in to_restart])
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
        told = self._drain(pool, known, killed, broken={k[0] for k in to_restart})
        a.rejoin |= {group for group, _ in told}  # their collectives are left: they join new ones
        self._adopt_spares(pool, killed - adopted)  # survivors the drain found stalled
        try:
            restarted = self._wait_restarted(pool, known, a.failure.cause)
        except NoCapacityError as exc:  # nothing to wait for: stop now, the run intact
            a.reason, a.abort_error = str(exc), exc
            return S.ABORTING
        a.restarted += restarted
        verdict = ctx.policy.record_restarts([budget_key(pool, k) for k in restarted])
        if verdict.decision is Decision.RAISE:
            a.reason = verdict.reason
            return S.ABORTING
        return S.REJOINING

    def _probe(self, pool: RecoveryPool, known: dict) -> tuple[list[ProcessKey], list[ProcessKey], list[ProcessKey]]:
        """(unresponsive, dead, replaced): known ranks that do not answer the health probe
        (stopped, hung outside a call), ranks whose process died, and ranks whose process was
        already replaced (restarted). A process still running its start-up imports may not answer
        in time: it is not taken as unresponsive here (a call waiting on it judges it by
        ``warmup_timeout_s``)."""
        unresponsive, dead, replaced = [], [], []
        for group in pool.process_groups():
            for rank, info in pool.probe(group, timeout_s=self.ctx.cfg.health_timeout_s).items():
                key = (group, rank)
                if key not in known:
                    continue
                if info is None:
                    if not _warming(known[key]):
                        unresponsive.append(key)
                elif isinstance(info, BaseException):
                    dead.append(key)
                elif info.pid != known[key].pid:
                    replaced.append(key)
        return unresponsive, dead, replaced

    @staticmethod
    def _hung_rank(a: Attempt, known: dict) -> ProcessKey | None:
        """The process ``a``'s error names as not advancing, if it is still the one known."""
        exc = a.exc
        if not isinstance(exc, WorkerTimeoutError) or exc.cause is not Cause.HANG or exc.rank is None \
                or a.group is None:
            return None
        info = known.get((a.group, exc.rank))
        if info is None or (exc.pid is not None and info.pid != exc.pid):
            return None
        return a.group, exc.rank

    def _kill(self, pool: RecoveryPool, key: ProcessKey, known: dict, kind: str, killed: set, **extra: Any) -> None:
        info = known[key]
        self.ctx.emit(kind, group=key[0], rank=key[1], pid=info.pid, node=info.node_id, **extra)
        pool.kill(key)
        killed.add(key)

    def _adopt_spares(self, pool: RecoveryPool, dead: set[ProcessKey]) -> set[ProcessKey]:
        """Hand the ``dead`` ranks to warm spares where their groups have ready ones."""
        adopted = set(pool.adopt_spares(sorted(dead))) if dead else set()
        for group, rank in sorted(adopted):
            self.ctx.emit("spare_adopted", group=group, rank=rank, role=pool.roles_of(group)[0])
        return adopted

    def _drain(self, pool: RecoveryPool, known: dict, killed: set, broken: set[str]) -> set[ProcessKey]:
        """Wait until no survivor is inside a call, so the rendezvous does not queue behind one;
        the survivors told to leave their collectives.

        A survivor of a ``broken`` process group (one of its ranks died) or of one with a rank in
        ``killed`` (before the drain or by it) is told to leave its collectives: no peer will join
        them, and a rank that only waits on live peers would otherwise wait out the group's
        timeout. So is a survivor of another group inside a collective that spans such a group (a
        weight sync: see :attr:`~resilient_rl.runtime.pool.RecoveryPool.shared_calls`). One that
        stays inside a call without advancing for ``hang_timeout_s`` is killed, as is one that does
        not answer (after ``warmup_timeout_s`` where it was still starting up). A preemption signal
        (the pool's ``interrupt`` raises) ends the wait at once: a survivor that keeps advancing
        would otherwise hold it up to ``restart_timeout_s``, past a scheduler's grace period."""
        cfg, clock = self.ctx.cfg, self.ctx.clock
        start = clock()
        deadline = start + cfg.restart_timeout_s
        shared = pool.shared_calls
        told: set[ProcessKey] = set()
        while clock() < deadline:
            pool.interrupt()  # a preemption signal ends the wait now, not at the drain's deadline
            busy = 0
            leave: list[ProcessKey] = []
            broken_now = broken | {group for group, _ in killed}  # also one the drain killed in
            cut_off = {group: calls for group, calls in shared.items() if group not in broken_now} \
                if broken_now & shared.keys() else {}
            for group in pool.process_groups():
                for rank, info in pool.probe(group, timeout_s=cfg.health_timeout_s, during_call=True).items():
                    key = (group, rank)
                    if key in killed or key not in known or isinstance(info, BaseException):
                        continue
                    if info is None and _warming(known[key]) and clock() - start < cfg.warmup_timeout_s:
                        busy += 1
                    elif info is None:
                        self._kill(pool, key, known, "kill_unresponsive", killed)
                    elif info.call is not None and info.pid == known[key].pid:
                        if (info.progress_age_s or 0.0) > cfg.hang_timeout_s:
                            self._kill(pool, key, known, "kill_hung", killed,
                                       reason=f"inside {info.call!r} without progress for {info.progress_age_s:.1f}s")
                        else:
                            busy += 1
                            if key not in told and (group in broken_now or info.call in cut_off.get(group, ())):
                                leave.append(key)
            if leave:
                told.update(leave)
                self.ctx.emit("leave_collectives", ranks=[list(k) for k in sorted(leave)])
                pool.leave_collectives(sorted(leave), reason="a rank of the group, or of the other side of a "
                                       "collective it is in, died")
            if not busy:
                return told
            self.ctx.sleep(0.05 if leave else 0.2)
        return told

    def _wait_restarted(self, pool: RecoveryPool, known: dict, cause: Cause) -> list[ProcessKey]:
        """Wait until every rank answers; the ranks that came back in a new process.

        Which ranks are new is read once every group has answered, from one more ping of all: a
        rank whose process died after it answered (its node went away, and its processes notice a
        moment later) and that Ray restarted meanwhile is then counted too, so its group rejoins."""
        for group in pool.process_groups():
            pool.wait_alive(group, self.ctx.cfg.restart_timeout_s)
        pool.refresh_workers()
        restarted = []
        for key, info in sorted(pool.workers().items()):
            old = known.get(key)
            if old is None or old.pid != info.pid:
                restarted.append(key)
                self.ctx.emit("worker_restarted", group=key[0], rank=key[1], pid=info.pid, node=info.node_id,
                              role=pool.roles_of(key[0])[0], cause=cause.value)
        return restarted


def _warming(info) -> bool:
    """Whether a process was still running its start-up imports when it last answered."""
    return bool(getattr(info, "warming", False))


def budget_key(pool: RecoveryPool, key: ProcessKey) -> tuple[str, int]:
    """(role, rank): the name a process's restart budget is kept under, the same for every
    controller of the run (process-group names carry a per-controller instance id)."""
    return pool.roles_of(key[0])[0], key[1]
