"""A controller's run from its start to its end: claim the run, start its roles and resume, shut down.

The order is what keeps a second controller, or a config that does not fit, from harming a run:
the config is checked against the checkpoint to resume and the run's leases are taken before
anything is written (:func:`claim`); only then do the workers start, and the run rolls back to the
point it resumes from (:func:`resume`), recovered like any step where a rank dies meanwhile. The
shutdown (:func:`shutdown`) leaves alone what belongs to another controller or to a cluster that
is gone.

Each function takes the :class:`~resilient_rl.trainer.ppo.PPOTrainer` it works on; the trainer's
methods call them.
"""

from __future__ import annotations

import logging

from resilient_rl.checkpoint.shared_root import require_shared_root
from resilient_rl.errors import WorkerError
from resilient_rl.recovery.rollback import SNAPSHOT, checkpoint
from resilient_rl.runtime import cluster
from resilient_rl.runtime.pool import WorkerPool
from resilient_rl.trainer.preemption import stop_if_nothing_to_recover, stop_recovering
from resilient_rl.trainer.resume_check import check_resume

logger = logging.getLogger(__name__)


def claim(trainer) -> None:
    """Check the config against the checkpoint a resume loads (ConfigError naming the keys
    that may not change), take the run's leases (run folder and checkpoint folder;
    LeaseHeldError when another controller holds one), then write the config: the first thing
    a controller writes, and before it opens its log or starts Ray (idempotent)."""
    if trainer._claimed:
        return
    if trainer.checkpoints_on:
        # A config that does not fit the checkpoint to resume is refused before anything is written.
        accepted = check_resume(trainer.cfg, trainer.ckpt.manager, trainer.run_dir.path, trainer.digest,
                                trainer._checkpoint_config)
        if accepted is not None:
            trainer.rollback.accepted_digests.add(accepted)
        trainer.claim_.acquire()
    trainer.run_dir.save_config(trainer.cfg)
    trainer.ckpt.prepare()  # an unwritable checkpoint root fails here, before any worker starts
    trainer._claimed = True


def start_roles(trainer) -> WorkerPool:
    """Start the roles once (claiming the run first) and resume; returns them."""
    if trainer.roles is None:
        if trainer.checkpoints_on:  # a node-local root cannot hold a multi-node run: before the lease
            require_shared_root(trainer.cfg.checkpoint, cluster.alive_nodes())
        trainer.claim()  # before any worker starts: a second controller is refused at once
        if trainer.telemetry is not None:
            trainer.telemetry.start()
        trainer.roles = trainer._roles_factory(trainer.cfg, trainer.tokenizer)
        if trainer.checkpoints_on:  # the pool recovery drives: its waits for ranks end on a preemption
            trainer.roles.interrupt = lambda: stop_recovering(trainer)
        if trainer.checkpoints_on:  # resume=off too: it sets the run's older steps aside
            resume(trainer)
        # Whatever the run, node memory left by owners that are gone (a killed controller's
        # snapshots once their keep has passed, a rank's reduction segment) is removed on every
        # node: once a snapshot the previous controller left there was tried.
        trainer.node_sweeps.now()
        if trainer.step == 0:  # a fresh start: an earlier history in the folder is not this run's
            trainer.run_dir.set_aside_history()
        if trainer.telemetry is not None:
            trainer.telemetry.watch_roles(trainer.roles, trainer.ckpt.last_committed_at())
    return trainer.roles


def resume(trainer) -> None:
    """Roll back to the checkpoint ``checkpoint.resume`` names; with ``auto``, first to the
    snapshot a previous controller left in node memory where it is newer than every commit
    (:mod:`resilient_rl.workers.snapshots.carry`: a preemption with no warning)."""
    resume_from = trainer.cfg.checkpoint.resume
    newest = max(trainer.ckpt.manager.committed_steps(), default=None)
    carried = resume_from == "auto" and trainer.snapshots is not None and trainer.snapshots.adopt(newest)
    if carried:  # before loading: the NaN guard's state says whether its save in flight committed since
        trainer.ckpt.last_committed = newest  # (a checkpoint restored instead sets its own step)
    points = (*((SNAPSHOT,) if carried else ()), checkpoint(resume_from))
    try:
        trainer.rollback.roll_back_to(trainer.roles, *points)
    except WorkerError as exc:  # a rank died while the state was loaded: recovered, to the same point
        stop_if_nothing_to_recover(trainer, exc)
        trainer.recovery.handle(exc, trainer.step, trainer.roles, points=points)


def shutdown(trainer) -> None:
    """Stop the telemetry and the roles, release the run; what another controller or a cluster
    that is gone owns is left alone."""
    # Never started (e.g. refused by the run's lease): stopping would delete the live
    # controller's Prometheus targets file in the shared run folder.
    if trainer.telemetry is not None and trainer.telemetry.server.running:
        trainer.telemetry.stop()
    # A preemption with no warning signals Ray's processes too, and a head node can be lost:
    # nothing is stopped or cleaned through a cluster that is gone (its workers go with it;
    # the next start sweeps node memory).
    ray_gone = trainer.roles is not None and not cluster.control_plane_answers()
    if ray_gone:
        logger.warning("Ray's cluster is gone: its workers and node memory are left to it")
    if trainer.roles is not None:
        if not ray_gone:
            trainer.roles.shutdown()
        trainer.roles = None
    # (A refused controller's key is the live run's.)
    if trainer.snapshots is not None and trainer._claimed and not ray_gone:
        trainer.snapshots.close()
    trainer.claim_.release()
    trainer._claimed = False
