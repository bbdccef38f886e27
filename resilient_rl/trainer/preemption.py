"""Preemption as an event: SIGTERM or SIGUSR1 stops the run at a safe point, its last step durable.

A scheduler that takes the machine back (a Slurm time limit or preemption, a Kubernetes pod
eviction, a spot reclaim) sends SIGTERM and, a grace period later, SIGKILL; Slurm can send an
early SIGUSR1 (``--signal=B:USR1@<seconds>``). Ray's ``ray.init`` installs a SIGTERM handler
that exits at once, so the run would be recorded as failed with its last steps lost.

:class:`Preemption` replaces those handlers (after Ray's start) with one that only notes the
signal; the fit loop checks it before each step, the safe point, and :func:`stop_for_preemption`
then makes the last completed step durable within ``trainer.preempt_grace_s``: a save in flight
is waited for and committed, and a step not yet saved is saved. The run then ends with
:class:`~resilient_rl.errors.Preempted`: ``controller.json`` says ``preempted``, the leases are
released as at any end, and the CLI exits 143. Running the same command again resumes from that
step: nothing completed is lost, nothing is repeated.

A preemption with no warning signals every process of the job, the workers and Ray's own
processes included, in no set order: a step fails with its workers (:func:`stop_after_lost_workers`),
or the signal lands while the failure is being recovered (:func:`stop_recovering`). Either way
the run stops as preempted, the newest snapshot left in node memory for the next controller.
Ray's cluster can also be gone with no signal (its head node lost): :func:`stop_after_lost_cluster`.
Before a recovery starts, :func:`stop_if_nothing_to_recover` tells these cases apart.

A signal arriving while the run is already stopping is noted in the log and changes nothing, up
to the process's exit: the durable save goes on until its grace period ends (the scheduler's
SIGKILL bounds it anyway), and the shutdown after it is not cut short by a signal. It is bounded
in time instead (:data:`SHUTDOWN_WITHIN_S`, :meth:`Preemption.exit_if_stuck`): Ray's control
plane can go down halfway through it, and the process still exits 143.

The signal can also land while the main thread is in a call that does not return on it, one into
Ray's control plane as it goes down: its handler cannot run, and Ray would end the process a
minute later with exit code 1. Or it lands just before the main thread enters such a call. A
thread sees the signal anyway (:mod:`.signal_watch`) and asks the main thread to act on a signal
every second until the run's end is recorded: past :data:`ANSWER_WITHIN_S` without an answer
it ends the run as preempted itself (:func:`end_while_stuck`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Callable

from resilient_rl.errors import Preempted, RecoveryError, RRLError, WorkerError
from resilient_rl.runtime import cluster
from resilient_rl.runtime.deadline_call import within
from resilient_rl.trainer.signal_watch import SignalWatch, exit_now

logger = logging.getLogger(__name__)

#: The signals that mean "the machine is being taken back" (SIGUSR1: Slurm's early warning).
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))

#: How long the shutdown after a preemption may take before the process exits without finishing
#: it. A preemption with no warning signals Ray's processes too, in no set order: the shutdown can
#: find Ray's control plane answering and lose it halfway, and a call into it then blocks until
#: Ray ends the process, 60 s later with exit code 1 (its ``gcs_rpc_server_reconnect_timeout_s``).
#: Everything durable is written and recorded before the shutdown starts.
SHUTDOWN_WITHIN_S = 30.0

#: After a preemption signal, how long the main thread may go without acting on a signal before
#: the run is ended from another thread (:mod:`.signal_watch`). It acts within milliseconds unless
#: it is in a call that does not return on one; Ray ends a process whose control plane is gone
#: after 60 s, and a scheduler's grace period before its SIGKILL is often 30 s.
ANSWER_WITHIN_S = 5.0
#: How long :func:`end_while_stuck` waits for the run's trackers (wandb, MLflow: network calls that
#: may hang once the job's network is gone) and its metrics exporter to close before the exit.
CLOSE_WITHIN_S = 5.0


class Preemption:
    """Notes a preemption signal for the fit loop to act on at its next safe point."""

    def __init__(self, answer_within_s: float = ANSWER_WITHIN_S) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None  # monotonic
        self.answer_within_s = answer_within_s
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None
        self._watch: SignalWatch | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, signal_name: str) -> None:
        """Ask the run to stop at its next safe point (what the signal handler does)."""
        if self._watch is not None:
            self._watch.handled()
        if self.signal_name is not None:
            logger.warning("%s received while already stopping for %s: ignored (the run is making its last step "
                           "durable or shutting down)", signal_name, self.signal_name)
            return
        self.signal_name, self.received_at = signal_name, time.monotonic()
        logger.warning("%s received: stopping after the step in progress and committing it (within "
                       "trainer.preempt_grace_s)", signal_name)

    def _handle(self, signum: int, _frame) -> None:
        self.request(signal.Signals(signum).name)

    def install(self, when_stuck: Callable[[], str] | None = None, exit_code: int = 143) -> bool:
        """Handle :data:`SIGNALS` from now on (call it after ``ray.init``, whose own SIGTERM handler
        exits at once); False where signals cannot be handled (not the main thread).

        With ``when_stuck``, once a signal arrived the main thread must act on signals until
        :meth:`exit_if_stuck` (the run's end recorded): where it goes ``answer_within_s`` without
        (it is in a call that does not return on one), the signal is noted from another thread,
        ``when_stuck()`` records the run's end and returns the line to print, and the process
        exits with ``exit_code``."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if when_stuck is not None:
            def end(name: str) -> str:
                self.signal_name, self.received_at = self.signal_name or name, self.received_at or time.monotonic()
                return when_stuck()

            self._watch = SignalWatch(SIGNALS, end, exit_code, self.answer_within_s)
            self._watch.start()
        return True

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced; when the run stopped for a preemption,
        ignore the signals instead until the process exits: a scheduler's SIGTERM after Slurm's
        SIGUSR1 then finds the run shutting down, and must not turn a clean stop into a death by
        signal. (Python puts the default action back for its own handlers as the interpreter
        exits, not for an ignored signal.)"""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        for sig, previous in self._previous.items():
            if self.requested:
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def exit_if_stuck(self, code: int, within_s: float = SHUTDOWN_WITHIN_S) -> None:
        """Exit the process with ``code`` if the shutdown it is about to run (workers, node memory,
        Ray's connection) has not ended ``within_s`` from now: a watchdog thread, cancelled by
        :meth:`shutdown_ended`. Call it once the run's end is recorded."""
        def stuck() -> None:
            logger.warning("the shutdown after the preemption did not end within %g s (Ray's cluster went down "
                           "with the job, it seems): exiting with %d, the run's end already recorded",
                           within_s, code)
            exit_now(code)

        if self._watch is not None:
            self._watch.ended()  # the end is recorded: the shutdown is bounded by this timer instead
        self._watchdog = threading.Timer(within_s, stuck)
        self._watchdog.daemon = True
        self._watchdog.start()

    def shutdown_ended(self) -> None:
        """The shutdown :meth:`exit_if_stuck` watches ended (in a process that goes on, a test's)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def ignore_after_shutdown(self) -> None:
        """``ray.shutdown`` puts the default SIGTERM action back below Python (``signal.getsignal``
        does not see it; a SIGTERM during its second or so of work still kills the process, by
        then with everything durable and recorded): ignore the signals again when stopping for a
        preemption, so the exit code stays 143."""
        if self.requested and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)


def stop_for_preemption(trainer, grace_s: float) -> None:
    """Make ``trainer``'s last completed step durable (bounded by ``grace_s`` from the signal) and
    raise Preempted naming the signal, the step and the last committed checkpoint."""
    preemption = trainer.preemption
    deadline = (preemption.received_at or time.monotonic()) + grace_s
    ckpt, roles, step = trainer.ckpt, trainer.roles, trainer.step
    if trainer.checkpoints_on and roles is not None and step > 0:
        try:
            if ckpt.pending is not None:  # a save in flight: commit it first
                ckpt.wait(roles, timeout_s=max(0.0, deadline - time.monotonic()))
            if ckpt.pending is None and ckpt.last_committed != step and ckpt.save_every > 0:  # 0: the user's "none"
                trainer.save_checkpoint()
                ckpt.wait(roles, timeout_s=max(0.0, deadline - time.monotonic()))
            if ckpt.pending is not None:
                logger.error("the checkpoint of step %d was not committed within trainer.preempt_grace_s=%gs",
                             ckpt.pending["step"], grace_s)
                ckpt.abandon(reason="preempted")
        except RRLError as exc:  # the run stops either way; what is committed is what counts
            logger.error("committing step %d before stopping failed: %s", step, exc)
    committed = ckpt.last_committed if trainer.checkpoints_on else None
    where = _where(step, committed) + _leave_snapshot(trainer, committed, step)
    raise Preempted(f"preempted by {preemption.signal_name} after step {step}: {where}",
                    signal_name=preemption.signal_name or "?", step=step, committed=committed)


def stop_if_nothing_to_recover(trainer, exc: WorkerError) -> None:
    """Before a recovery: stop where its workers went with the whole job (a preemption signal,
    or Ray's control plane gone: a call through it would block until Ray ends the process)."""
    if not trainer.preemption.requested and trainer.checkpoints_on:
        waited = cluster.CONTROL_PLANE_WAIT_S
        if not cluster.control_plane_back(waited, give_up=lambda: trainer.preemption.requested) \
                and not trainer.preemption.requested:
            stop_after_lost_cluster(trainer, exc, waited)
    if trainer.preemption.requested:  # the workers stopped with the same signal
        stop_after_lost_workers(trainer, exc)


def stop_after_lost_workers(trainer, exc: BaseException) -> None:
    """A step failed after a preemption signal: the scheduler signalled the workers too (a
    requeue or a kill with no early warning stops every process of the job), so there is nothing
    to recover and nothing left to save the step from. Raise Preempted at once, naming the last
    committed checkpoint, instead of starting a recovery the scheduler's SIGKILL would cut short
    with nothing recorded. A save in flight is abandoned (its writers are gone)."""
    logger.warning("step %d failed after %s (%s): the workers stopped with the preemption; not recovering",
                   trainer.step + 1, trainer.preemption.signal_name, exc)
    _stop_without_workers(trainer, f"during step {trainer.step + 1}, whose workers stopped with it")


def stop_recovering(trainer) -> None:
    """The pool's ``interrupt``, called by its waits for ranks and by the recovery between its
    states: after a preemption signal, stop the recovery as :func:`stop_after_lost_workers` stops a
    step. The signal may land just
    after the failure it caused was seen: the workers went down with the job before the controller
    was told."""
    if trainer.preemption.requested:
        logger.warning("%s received while recovering step %d: the job is stopping, its workers with it; the "
                       "recovery stops", trainer.preemption.signal_name, trainer.step + 1)
        _stop_without_workers(trainer, f"while recovering step {trainer.step + 1}")


def end_while_stuck(trainer) -> str:
    """The end of a run whose main thread is stuck in a call that does not return on the
    preemption signal (:mod:`.signal_watch`; Ray's control plane went down with the job): from
    the watching thread, as :func:`stop_recovering` would have ended it (a save in flight
    abandoned, the newest snapshot left in node memory), ``controller.json`` marked preempted, the
    run's leases released, then its trackers and metrics exporter closed (:func:`_close_outputs`).
    Returns the line the CLI prints before it exits 143.

    Where the main thread recorded the run's end first (it got stuck in the shutdown after a
    failure), that record stands, and the line says so."""
    name, record = trainer.preemption.signal_name, trainer.controller_record
    if record is not None and record.state != "running":
        trainer.claim_.release()
        return (f"{name} received after the run ended ({record.state}, recorded in controller.json), the controller "
                "stuck in a call that does not return on a signal: exiting")
    _, where = _without_workers(trainer, reason="preempted")
    message = (f"preempted by {name} after step {trainer.step}, the controller stuck in a call that does not return "
               f"on a signal: {where}")
    if record is not None:
        record.end(trainer.run_dir.path, "preempted", trainer.step, message)
    trainer.claim_.release()
    _close_outputs(trainer)
    return message


def _close_outputs(trainer) -> None:
    """Close what ``fit`` and ``shutdown`` would have closed on the way out, within
    :data:`CLOSE_WITHIN_S`: the trackers (their last rows and events, the run ended, not left
    running for wandb to call crashed) and the metrics exporter (its time ledger written, its
    Prometheus targets file removed). Past the deadline the process exits all the same."""
    trackers, telemetry = getattr(trainer, "trackers", None), getattr(trainer, "telemetry", None)

    def close() -> bool:
        if trackers is not None:
            trackers.close()
        if telemetry is not None:
            telemetry.stop()
        return True

    if not within("run outputs", close, CLOSE_WITHIN_S, otherwise=False):
        logger.warning("the run's trackers and metrics exporter did not close within %.0f s: exiting without them",
                       CLOSE_WITHIN_S)


def stop_after_lost_cluster(trainer, exc: BaseException, waited_s: float) -> None:
    """A step failed and Ray's control plane has not answered for ``waited_s``, with no preemption
    signal: the cluster the run was on is gone (its head node lost, or stopped), and every worker
    with it. Nothing can be recovered on it: raise RecoveryError naming where the same command
    continues, the newest snapshot left in node memory as at a preemption."""
    _, where = _without_workers(trainer, reason="cluster lost")
    raise RecoveryError(f"step {trainer.step + 1} failed ({exc}) and Ray's control plane has not answered for "
                        f"{waited_s:g}s: the cluster this run was on is gone, and its workers with it; {where}")


def _stop_without_workers(trainer, when: str) -> None:
    preemption = trainer.preemption
    committed, where = _without_workers(trainer, reason="preempted")
    raise Preempted(f"preempted by {preemption.signal_name} {when}: {where}",
                    signal_name=preemption.signal_name or "?", step=trainer.step, committed=committed)


def _without_workers(trainer, reason: str) -> tuple[int | None, str]:
    """Stopping with the workers gone: abandon a save in flight (its writers are gone), leave the
    newest snapshot for the next controller; (last commit, where the same command continues)."""
    ckpt, step = trainer.ckpt, trainer.step
    if trainer.checkpoints_on and ckpt.pending is not None:
        ckpt.abandon(reason=reason)
    committed = ckpt.last_committed if trainer.checkpoints_on else None
    return committed, _where(step, committed) + _leave_snapshot(trainer, committed, step)


def _leave_snapshot(trainer, committed: int | None, step: int) -> str:
    """Where the last completed step is not committed (its workers stopped with the signal, or its
    save did not finish in time): leave the run's newest recorded in-memory snapshot in node memory
    for the next controller of the run (workers/snapshots/carry.py), so that the steps after the
    commit are not run again where the job comes back on the same nodes. What to add to the
    message."""
    keeper = trainer.snapshots
    if keeper is None or committed == step:
        return ""
    left = keeper.hand_over_after(committed)
    if left is None:
        return ""
    return (f"; the newest in-memory snapshot (step {left}) is left in node memory, where the next run "
            "continues from it if it starts on the same nodes")


def _where(step: int, committed: int | None) -> str:
    """Where the same command continues a run stopped after ``step``."""
    if committed == step:
        return f"step {step} is committed; the same command continues from it"
    if committed is not None:
        return (f"the last committed checkpoint is step {committed}; the same command continues from it"
                + (f" (step {step} is run again)" if committed + 1 == step
                   else f" (steps {committed + 1}-{step} are run again)" if committed < step else ""))
    return "no checkpoint is committed (checkpoint.save_every=0 or none yet)"
