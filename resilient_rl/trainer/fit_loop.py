"""The fit loop: train to ``trainer.total_steps``, each failure on the way handled where it is met.

:func:`fit` opens what lives as long as the run (``train.log``, the trackers, ``controller.json``)
and starts the roles; :func:`run` is the loop. Between two steps, its safe point, it acts on a
preemption signal. After a step the NaN guard judges its row (a NaN or Inf rolls the run back
past the step), then a checkpoint and a snapshot are taken when due, and the last step's save is
waited for. A :class:`~resilient_rl.errors.WorkerError` (a rank died, hung or broke a collective)
is recovered (:mod:`resilient_rl.recovery.driver`), unless its workers went with the whole job
(:func:`~resilient_rl.trainer.preemption.stop_if_nothing_to_recover`); the loop then goes on from
the restored step, first saving it when the recovery abandoned a save it would otherwise lose
(:func:`save_after_recovery`).

Each function takes the :class:`~resilient_rl.trainer.ppo.PPOTrainer` it works on; the trainer's
methods call them.
"""

from __future__ import annotations

from resilient_rl.errors import WorkerError
from resilient_rl.run.log import RunLog
from resilient_rl.run.record import controller_session
from resilient_rl.telemetry.trackers import build_trackers
from resilient_rl.trainer.preemption import stop_for_preemption, stop_if_nothing_to_recover


def fit(trainer) -> list[dict]:
    """Train to ``total_steps``; returns the newest rows of the metric history (at most
    :data:`~resilient_rl.trainer.ppo.HISTORY_WINDOW`; the whole history is ``trainer.run_dir.read_metrics()``).

    ``controller.json`` in the run folder names this process while it runs and says how it ended.
    The whole log goes to ``train.log`` in the run folder; metrics and events go to the
    trackers of ``trainer.loggers`` (the console gets a summary every ``trainer.log_every`` steps).
    """
    from tqdm import tqdm

    trainer.claim()  # a refused controller opens no log and writes nothing
    with RunLog(trainer.run_dir.path / "train.log"):
        trainer.trackers = build_trackers(trainer.cfg, trainer.run_dir)
        try:
            with controller_session(trainer.run_dir.path, lambda: trainer.step) as record:
                trainer.controller_record = record  # for end_while_stuck
                trainer.start_roles()
                record.start_step = trainer.step
                record.write(trainer.run_dir.path)
                return run(trainer, tqdm)
        finally:
            trainer.trackers.close()
            trainer.trackers = None


def save_after_recovery(trainer, in_flight: int | None) -> bool:
    """Whether the step a recovery restored is saved before the run goes on; ``in_flight`` is the
    step whose save was in flight when the failure came (the recovery abandoned it).

    It is saved when it is a due step not committed (restored from its snapshot, its save
    abandoned: the run is not done before its last step is committed), and when the abandoned
    save is older than the restored step (restored from a newer snapshot): the abandoned step is
    never trained again, so its checkpoint would be lost and the newest durable state would stay
    older than the schedule promises until the next due step, up to a whole interval longer."""
    ckpt = trainer.ckpt
    if not trainer.checkpoints_on or trainer.step == 0 or ckpt.pending is not None:
        return False
    committed = ckpt.last_committed or 0
    if committed >= trainer.step:
        return False
    return ckpt.due(trainer.step) or (in_flight is not None and committed < in_flight <= trainer.step)


def run(trainer, tqdm) -> list[dict]:
    """The loop of :func:`fit`, its roles started: steps to ``total_steps``, with a progress bar
    made by ``tqdm``; returns the newest rows of the metric history."""
    total = trainer.cfg.trainer.total_steps
    bar = tqdm(total=total, initial=trainer.step, disable=not trainer.cfg.trainer.progress_bar, unit="step",
               dynamic_ncols=True)
    resave = False  # a recovery restored a step whose save it abandoned: save it again
    try:
        while trainer.step < total or resave:
            if trainer.preemption.requested:  # the safe point: between steps, none half done
                stop_for_preemption(trainer, trainer.cfg.trainer.preempt_grace_s)
            try:
                if resave:
                    resave = False
                    trainer.save_checkpoint()
                    if trainer.step >= total:
                        trainer.ckpt.finish(trainer.roles)
                    continue
                if trainer.validator.due_before_train(trainer.step, trainer.history):
                    trainer.validate_before_train()
                row = trainer.train_step()
                verdict = trainer.nonfinite.after_step(row, trainer.ckpt.last_committed)
                if not verdict:  # a NaN/Inf: roll back past it
                    trainer.roll_back_nonfinite(row["step"], verdict.roll_back)
                    bar.n = trainer.step
                    bar.refresh()
                    continue
                trainer.maybe_checkpoint()
                trainer.maybe_snapshot()
                trainer.node_sweeps.maybe()
                if trainer.step >= total and trainer.checkpoints_on:
                    # The last save, waited for (bounded) inside the recovery: a rank that lost
                    # it rolls the run back (to the last commit, or to the last step's snapshot,
                    # which is then saved again) and the final steps are replayed.
                    for hook in trainer.hooks:
                        hook.on_final_save_wait(trainer, trainer.step)
                    trainer.ckpt.finish(trainer.roles)
            except WorkerError as exc:
                stop_if_nothing_to_recover(trainer, exc)
                in_flight = (trainer.ckpt.pending or {}).get("step")  # the recovery abandons it
                # Pools that save no checkpoints run in this process: nothing to restart there.
                trainer.recovery.handle(exc, trainer.step + 1, trainer.roles if trainer.checkpoints_on else None)
                resave = save_after_recovery(trainer, in_flight)
                bar.n = trainer.step
                bar.refresh()
                continue
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}", step_s=f"{row['timing/step_s']:.2f}")
    finally:
        bar.close()
    return list(trainer.history)
