"""Claiming a run before anything of it is started or written.

A controller writes two places: the run folder (``{trainer.output_dir}/{trainer.run_name}``:
config, metrics, events, logs, controller record, Prometheus targets) and the checkpoint folder
(``{checkpoint.root}/{run_name}``). Either one shared with a live controller is damage: a second
controller with another checkpoint root but the same run folder would append its steps to the live
run's ``metrics.jsonl``; one with another run folder but the same checkpoint root would un-commit its
steps. So a controller takes a lease on each (:class:`~resilient_rl.checkpoint.leases.run_lease.RunLease`),
the run folder's one first, and only then writes its config, opens its log, starts Ray or its
exporter. A refused controller has read the two lease folders and written nothing.

The run folder's claims live in ``{run folder}/run_lease/`` (not ``lease/``: a checkpoint root equal
to ``trainer.output_dir`` would otherwise make the two leases one and the same files).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from resilient_rl.checkpoint.leases.run_lease import RunLease
from resilient_rl.checkpoint.retry import is_outage
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.errors import ConfigError, LeaseError, StorageError

logger = logging.getLogger(__name__)

#: The folder, inside the run folder, of the run folder's lease claims.
RUN_LEASE_DIR = "run_lease"


def run_folder_lease(cfg, run_path: Path, clock=None) -> RunLease:
    """The (not yet acquired) lease on the run folder ``run_path``, with the checkpoint lease's
    TTL, renewal period and one-start ``checkpoint.takeover``."""
    c = cfg.checkpoint
    extra = {"clock": clock} if clock is not None else {}
    folder = Path(run_path).resolve()
    return RunLease(Storage(str(folder.parent)), folder.name, c.lease_ttl_s, c.lease_renew_s,
                    takeover=c.takeover, lease_dir=RUN_LEASE_DIR, **extra)


@contextlib.contextmanager
def _unwritable_is_config(key: str, value: str):
    """A lease that cannot be written for good (not a passing outage) is a setting to fix."""
    try:
        yield
    except StorageError as exc:
        if is_outage(exc):
            raise
        raise ConfigError(f"{key}={value!r} cannot be written: {exc}") from exc


class RunClaim:
    """Both leases of one controller: the run folder's and the checkpoint folder's (through the
    :class:`~resilient_rl.checkpoint.coordinator.CheckpointCoordinator`, which fences its writes)."""

    def __init__(self, cfg, run_path: Path, checkpoints, clock=None):
        self.cfg = cfg
        self.run_path = Path(run_path)
        self.checkpoints = checkpoints
        self.clock = clock
        self.folder: RunLease | None = None

    @property
    def held(self) -> bool:
        return self.folder is not None and self.folder.lease is not None

    def acquire(self) -> None:
        """Take the run folder's lease, then the checkpoint folder's; raise LeaseHeldError (naming
        the holder) when another controller holds either. Nothing else has been written then."""
        if self.held:
            return
        self.folder = run_folder_lease(self.cfg, self.run_path, self.clock)
        try:
            with _unwritable_is_config("trainer.output_dir", self.cfg.trainer.output_dir):
                self.folder.acquire()
            with _unwritable_is_config("checkpoint.root", self.cfg.checkpoint.root):
                self.checkpoints.acquire_lease(**({"clock": self.clock} if self.clock is not None else {}))
        except BaseException:
            self.release()
            raise
        self.folder.start_renewing()

    def raise_if_lost(self) -> None:
        """Raise LeaseLostError when the run folder was taken over (found by the renewal thread)."""
        if self.folder is not None and self.folder.lease is not None:
            self.folder.raise_if_lost()

    def release(self) -> None:
        """Release both leases (each a no-op when not held); never raises."""
        try:
            self.checkpoints.release_lease()
        except LeaseError as exc:  # a controller shutting down must not fail on its lease
            logger.warning("releasing the checkpoint lease failed: %s", exc)
        if self.folder is not None:
            self.folder.close()
            self.folder = None
