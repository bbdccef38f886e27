"""The project's error tree.

Every error raised on purpose by resilient-rl derives from :class:`RRLError`, so a caller can
catch the project's failures in one place. Errors are classified where they cross a boundary
(a Ray call, a storage call, a config file), and every message names the thing at fault:
the config key, the path, the checkpoint, the role and rank.
"""

from __future__ import annotations

import time
from enum import Enum


class Cause(str, Enum):
    """Why a step (or a recovery) failed, named where the failure is raised.

    A ``str`` enum: its value is what events, logs and the ``cause`` metric label carry. A
    :class:`WorkerError` carries one; an unknown name is a bug at the raise site (ValueError),
    never a silent "unknown".
    """

    DIED = "died"                # a worker process exited (SIGKILL, OOM, crash)
    TIMEOUT = "timeout"          # a call passed its ceiling
    HANG = "hang"                # a rank stopped advancing inside a call
    COLLECTIVE = "collective"    # a collective broke (a peer died or left)
    NODE_LOST = "node_lost"      # the node under a worker went away
    UNAVAILABLE = "unavailable"  # a worker cannot be reached (restarting, network)
    STORAGE = "storage"          # checkpoint storage unreachable past its retries
    EXHAUSTED = "exhausted"      # Ray has no restarts left for an actor
    STALE_WEIGHTS = "stale_weights"  # the rollout does not hold the weights it should
    ERROR = "error"              # a project error (bad config, corrupt state): a bug to fix
    EXCEPTION = "exception"      # an exception raised by user or library code
    UNKNOWN = "unknown"          # a worker call failed in a way Ray did not describe


class RRLError(Exception):
    """Root of every error raised by resilient-rl."""


class ConfigError(RRLError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


class DataProtoError(RRLError, ValueError, AssertionError):
    """A DataProto operation got inconsistent batches (length, keys, split sizes).

    Also an ``AssertionError``: verl asserts where this is raised, and ported code catches that."""


class DispatchError(RRLError, ValueError, AssertionError):
    """Arguments of a worker-group call cannot be dispatched (wrong length, unknown method).

    Also an ``AssertionError``, where verl asserts."""


class ResourceError(RRLError):
    """Cluster resources cannot satisfy a request (e.g. GPUs asked on a CPU-only cluster)."""


class ClusterError(RRLError):
    """The Ray cluster named by ``ray.address`` (or ``RAY_ADDRESS``) cannot be reached or joined."""


class WorkerError(RRLError):
    """A worker failed: died, hung past its deadline or raised. Names role, rank and its
    :class:`Cause` (each subclass has its own default; a name is checked here).

    ``raised_at`` (monotonic seconds) is when the controller learnt of the failure: recovery's
    detect phase runs from there (from the start of a hang, for a hung worker) to recovery starting."""

    default_cause = Cause.EXCEPTION

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None,
                 cause: Cause | str | None = None):
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.cause: Cause = self.default_cause if cause is None else Cause(cause)
        self.raised_at = time.monotonic()


class WorkerDiedError(WorkerError):
    """The worker's process is gone (killed, crashed, node lost)."""

    default_cause = Cause.DIED


class WorkerTimeoutError(WorkerError):
    """A worker is hung (cause "hang": it stopped answering its health call, or stopped advancing
    inside a call; ``hang_kind`` says which, ``pid`` names its process where known and
    ``stalled_s`` how long it had been silent or still when judged hung) or a call passed its
    ceiling (cause "timeout")."""

    default_cause = Cause.TIMEOUT

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None,
                 cause: Cause | str | None = None, pid: int | None = None, hang_kind: str | None = None,
                 stalled_s: float | None = None):
        super().__init__(message, role=role, rank=rank, cause=cause)
        self.pid = pid
        self.hang_kind = hang_kind
        self.stalled_s = stalled_s


class CollectiveError(WorkerError):
    """A torch.distributed collective failed on a surviving rank (a peer died or timed out)."""

    default_cause = Cause.COLLECTIVE


class DeviceMemoryError(WorkerError):
    """A worker's pass ran out of device memory. Not retried (the same pass needs the same memory
    again): the message names the pass, what the device held, and the config keys that make the
    pass need less; the last checkpoint stays the run's, to resume with them changed."""

    default_cause = Cause.EXCEPTION


class CheckpointError(RRLError):
    """A checkpoint cannot be written, found or read."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint fails verification (missing file, size or checksum mismatch)."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint written by a newer version (a higher ``format_version``): not corrupt, and never
    skipped or set aside as if it were; the run stops and names the upgrade."""


class NoValidCheckpointError(CheckpointCorruptError):
    """The run has committed checkpoints and none of them verifies: it stops rather than start
    over (which would set them aside and cut its metric history)."""


class StorageError(CheckpointError):
    """The storage backend failed permanently (after retries).

    ``outage`` is True when the error was transient but outlasted the retries (a later attempt
    may get through): a checkpoint save meeting it is skipped, not fatal."""

    def __init__(self, *args, outage: bool = False):
        super().__init__(*args)
        self.outage = outage


class StaleWriteError(StorageError):
    """A background shard write from before a recovery found its step committed by a later save:
    its file is dropped, never published over the committed one."""


class CheckpointsSkippedError(StorageError):
    """Checkpoint saves failed ``checkpoint.max_skipped`` times in a row and one more failed: the
    run stops, its last committed checkpoint intact (``checkpoint/`` storage outage, see
    ``trainer/checkpointing.py``)."""


class LeaseError(CheckpointError):
    """The run's single-writer lease cannot be taken or was lost (see ``checkpoint/leases/run_lease.py``)."""


class LeaseHeldError(LeaseError):
    """Another controller holds a live lease on the run: this one refuses to write it."""


class LeaseLostError(LeaseError):
    """Another controller took the run over: this one stops without writing or deleting anything."""


class LeaseExpiredError(LeaseLostError):
    """The lease was not renewed in time (its storage could not be read or written): another
    controller may take the run over from now on, so this one stops writing by itself."""


class LeaseFormatError(LeaseError):
    """A lease claim this version cannot read (a newer format, or fields it does not know)."""


class RecoveryError(RRLError):
    """Recovery gave up: the failure budget is spent or the failure is not recoverable."""


class TelemetryError(RRLError):
    """The metrics exporter cannot start (e.g. its port is in use)."""


class AlgoInputError(RRLError, ValueError):
    """Inputs to an RL algorithm function are inconsistent (shapes, lengths of a prompt index)."""


class ModelInputError(RRLError, ValueError):
    """Tensors given to a model or to generation have inconsistent shapes or values."""


class TokenizerError(RRLError, ValueError):
    """Text holds a character the tokenizer's alphabet does not cover (names it and its position)."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A background checkpoint write did not finish within its deadline (also a TimeoutError)."""


class RunFolderError(RRLError):
    """A run folder (``{trainer.output_dir}/{run_name}``) is missing, is not a run's folder, or holds a
    file (metrics.jsonl, events.jsonl) damaged beyond a torn last line."""


class NonFiniteError(RRLError):
    """Training met NaN or Inf values (loss, gradient norm, reward, KL, saved state) and the
    ``trainer.nonfinite`` policy or its ``trainer.max_nonfinite`` budget ends the run; names the
    step and the quantities."""


class GradientError(RRLError):
    """An update's backward gave the model's parameters gradients but none to the parameters its
    optimizer steps (a sharding wrapper whose hooks did not run): the run would train nothing."""


class UserCodeError(RRLError):
    """Code the user supplied (``data.reward_fn``) raised. The message names the setting and the
    function and carries the function's own traceback; the project's frames are left out, and
    the exit code is the run-time one (4), not "internal error"."""


class NoCapacityError(RecoveryError):
    """Ranks were lost with their node and no alive node can hold their placement group (and
    none is being launched): recovery stops at once instead of waiting for a place that will not
    come. Names the lost node, the ranks and the resources missing; the last committed
    checkpoint and the run folder are intact, and the same command continues the run once the
    cluster has the capacity again. The CLI exits 75 (``EX_TEMPFAIL``: try again later)."""


class Preempted(RRLError):
    """The run was asked to stop (SIGTERM, Slurm's early SIGUSR1) and stopped at a safe point after
    making its last completed step durable where it could; names the signal, the step and the last
    committed checkpoint. Not a failure: the CLI exits 143 and ``controller.json`` says
    ``preempted``; the same command continues the run."""

    def __init__(self, message: str, *, signal_name: str, step: int, committed: int | None):
        super().__init__(message)
        self.signal_name, self.step, self.committed = signal_name, step, committed
