"""The project's error tree.

Every error raised on purpose by resilient-rl derives from :class:`RRLError`, so a caller can
catch the project's failures in one place. Errors are classified where they cross a boundary
(a Ray call, a storage call, a config file), and every message names the thing at fault:
the config key, the path, the checkpoint, the role and rank.
"""

from __future__ import annotations


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


class WorkerError(RRLError):
    """A worker failed: died, hung past its deadline or raised. Names role and rank."""

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None,
                 cause: str | None = None):
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.cause = cause


class WorkerDiedError(WorkerError):
    """The worker's process is gone (killed, crashed, node lost)."""


class WorkerTimeoutError(WorkerError):
    """A worker is hung (cause "hang": it stopped answering its health call, or stopped advancing
    inside a call; ``hang_kind`` says which and ``pid`` names its process where known) or a call
    passed its ceiling (cause "timeout")."""

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None,
                 cause: str | None = None, pid: int | None = None, hang_kind: str | None = None):
        super().__init__(message, role=role, rank=rank, cause=cause)
        self.pid = pid
        self.hang_kind = hang_kind


class CollectiveError(WorkerError):
    """A torch.distributed collective failed on a surviving rank (a peer died or timed out)."""


class CheckpointError(RRLError):
    """A checkpoint cannot be written, found or read."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint fails verification (missing file, size or checksum mismatch)."""


class StorageError(CheckpointError):
    """The storage backend failed permanently (after retries).

    ``outage`` is True when the error was transient but outlasted the retries (a later attempt
    may get through): a checkpoint save meeting it is skipped, not fatal."""

    def __init__(self, *args, outage: bool = False):
        super().__init__(*args)
        self.outage = outage


class CheckpointsSkippedError(StorageError):
    """Checkpoint saves failed ``checkpoint.max_skipped`` times in a row and one more failed: the
    run stops, its last committed checkpoint intact (``checkpoint/`` storage outage, see
    ``trainer/checkpointing.py``)."""


class LeaseError(CheckpointError):
    """The run's single-writer lease cannot be taken or was lost (see ``checkpoint/lease.py``)."""


class LeaseHeldError(LeaseError):
    """Another controller holds a live lease on the run: this one refuses to write it."""


class LeaseLostError(LeaseError):
    """Another controller took the run over: this one stops without writing or deleting anything."""


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
