"""The event kinds of ``events.jsonl``: one frozen dataclass per kind, registered by name.

See :mod:`resilient_rl.events` for the line format and the versioning rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from resilient_rl.errors import RRLError

#: Version of the line format and of every kind's fields; written as ``v`` on every line.
SCHEMA_VERSION = 2  # 2: ``recovered`` gained ``phases``
#: Keys of a line that are not fields of its event.
ENVELOPE = ("event", "v", "time")


class EventSchemaError(RRLError, ValueError):
    """An event of an unknown kind, or with fields its kind does not have or lacks."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every event type: ``kind`` (the class's registered name) and the wall-clock ``time``."""

    kind: ClassVar[str] = ""
    time: float

    def payload(self) -> dict[str, Any]:
        """The event's fields without ``time``, by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "time"}


@dataclass(frozen=True)
class UnknownEvent:
    """A line this code cannot check: an unknown kind, a newer ``version``, or an unversioned line
    that fits no known type. ``data`` holds its fields as written (without the envelope)."""

    kind: str
    time: float
    version: int | None
    data: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        return dict(self.data)


AnyEvent = Union[Event, UnknownEvent]

#: kind -> event type, for every kind the code emits.
EVENT_TYPES: dict[str, type[Event]] = {}


def _kind(name: str):
    def register(cls):
        cls.kind = name
        cls = dataclass(frozen=True, kw_only=True)(cls)
        EVENT_TYPES[name] = cls
        return cls
    return register


# ---------------------------------------------------------------------------- workers (trainer/resilience.py)
@dataclass(frozen=True, kw_only=True)
class _WorkerEvent(Event):
    group: str    # the process group (worker group name prefix) of the process
    rank: int
    pid: int
    node: str | None


@_kind("worker_restarted")
class WorkerRestarted(_WorkerEvent):
    """A worker process came back (Ray restarted it, or a warm spare took its place) during a
    recovery: ``role`` is the role it is reported under (the first of the roles sharing it),
    ``cause`` the failure's cause."""

    role: str | None = None
    cause: str | None = None


@_kind("spare_adopted")
class SpareAdopted(Event):
    """A warm spare (``recovery.spares``) took the place of ``group`` rank ``rank``, whose process
    died, instead of a restart of that process (the ``worker_restarted`` that follows names it)."""

    group: str
    rank: int
    role: str | None = None


@_kind("kill_unresponsive")
class KillUnresponsive(_WorkerEvent):
    """The controller killed a worker that did not answer its health probe (stopped)."""


@_kind("kill_hung")
class KillHung(_WorkerEvent):
    """The controller killed a worker that answered but stopped advancing inside a call."""

    reason: str


@_kind("leave_collectives")
class LeaveCollectives(Event):
    """Survivors ``ranks`` (``[group, rank]`` pairs) were inside a call on a process group that
    lost a rank, and were told to leave its collectives (:mod:`resilient_rl.runtime.leave_collective`)."""

    ranks: list


# ---------------------------------------------------------------------------- recovery (trainer/resilience.py)
@_kind("failure")
class FailureEvent(Event):
    """Step ``step`` failed; recovery starts. ``role`` and ``rank`` name the failing worker's role
    (``actor``, ``critic``, ...), ``group`` its process group where known (older runs: none, and
    ``role`` may hold a worker-group name); ``cause`` is a
    :class:`~resilient_rl.recovery.policy.Cause` value."""

    step: int
    role: str | None
    rank: int | None
    cause: str
    message: str | None
    group: str | None = None


@_kind("failure_during_recovery")
class FailureDuringRecovery(Event):
    """Another failure while recovering, in recovery state ``state`` (fields as :class:`FailureEvent`)."""

    state: str
    role: str | None
    rank: int | None
    cause: str
    message: str | None
    group: str | None = None


@_kind("recovery_state")
class RecoveryStateEntered(Event):
    """A recovery of the failure at ``failed_step`` entered ``state`` (``recovering``, ``rejoining``,
    ``restoring`` or ``aborting``): where a recovery that has not ended stands."""

    state: str
    failed_step: int


@_kind("recovery_backoff")
class RecoveryBackoff(Event):
    """The failure being recovered from is the ``in_a_row``-th with no step completed since the
    first: the recovery waits ``wait_s`` before it acts (:mod:`resilient_rl.recovery.backoff`)."""

    in_a_row: int
    wait_s: float


@_kind("recovered")
class Recovered(Event):
    """Recovery finished: restored ``restored_step``, replays from there; ``restarted`` lists the
    restarted workers as ``[group, rank]``, ``rejoined`` the process groups that joined a new
    generation (the others kept theirs); ``generation`` is the new process-group generation."""

    failed_step: int
    restored_step: int
    steps_replayed: int
    duration_s: float
    restarted: list
    generation: int
    source: str | None = None  # "snapshot" (in memory), "checkpoint" (storage) or "start"
    # Seconds per phase: detect, restart, rejoin, restore (trainer/recovery_phases.py); v2 on.
    phases: dict | None = None
    rejoined: list | None = None  # older runs: not recorded


@_kind("snapshot_restored")
class SnapshotRestored(Event):
    """A recovery loaded the in-memory snapshot of ``step``; ``sources`` counts the ranks per copy
    read (``own``: the rank's process survived, ``node``: the copy it left in its node's memory,
    ``object_store``, ``peer``: its ring neighbour)."""

    step: int
    duration_s: float
    sources: dict


@_kind("snapshot_unusable")
class SnapshotUnusable(Event):
    """A recovery could not use the snapshot of ``step`` (some rank's copies are all lost, or
    the world size changed); it falls back to an older snapshot or to storage."""

    step: int
    reason: str


@_kind("snapshot_corrupt")
class SnapshotCorrupt(Event):
    """A rank's copy of the snapshot of ``step`` (``source``: own, node, object_store or peer)
    failed its checksum when loaded: it was not restored, the rank tries its next copy (then an
    older snapshot, then storage)."""

    step: int
    role: str
    rank: int
    source: str
    reason: str


@_kind("aborted")
class Aborted(Event):
    """The failure budget is spent: the run stops, ``last_committed_step`` intact."""

    reason: str
    role: str | None
    rank: int | None
    last_committed_step: int | None


# ---------------------------------------------------------------------------- checkpoints (trainer/checkpointing.py)
@_kind("lease_acquired")
class LeaseAcquired(Event):
    """This controller holds the run's lease; ``previous`` describes the holder it took over from."""

    holder: str
    token: int
    expires_at: float
    previous: dict | None


@_kind("checkpoint_started")
class CheckpointStarted(Event):
    """The save of ``step`` started; the step was blocked ``stall_s`` seconds."""

    step: int
    stall_s: float


@_kind("checkpoint_committed")
class CheckpointCommitted(Event):
    """The checkpoint of ``step`` is committed (its manifest written). ``known_good`` is False
    when the run met a NaN/Inf since the last known-good checkpoint (None: not recorded)."""

    step: int
    duration_s: float
    stall_s: float
    bytes: int
    known_good: bool | None = None


@_kind("checkpoint_skipped")
class CheckpointSkipped(Event):
    """The save of ``step`` was skipped (``reason``: slow, storage); training goes on."""

    step: int
    reason: str
    in_row: int
    detail: str


@_kind("checkpoint_abandoned")
class CheckpointAbandoned(Event):
    """The save in flight of ``step`` was given up; it is never committed."""

    step: int
    reason: str


@_kind("checkpoint_refused")
class CheckpointRefused(Event):
    """The state saved at ``step`` holds NaN/Inf (``role``): it is not committed."""

    step: int
    role: str
    reason: str


@_kind("checkpoint_corrupt")
class CheckpointCorrupt(Event):
    """The committed checkpoint of ``step`` failed verification; an older one is used."""

    step: int
    reason: str


@_kind("checkpoint_restored")
class CheckpointRestored(Event):
    """The checkpoint of ``step`` (at URL ``source``) was loaded."""

    step: int
    duration_s: float
    source: str


@_kind("checkpoints_set_aside")
class CheckpointsSetAside(Event):
    """Committed ``steps`` off the timeline continued from ``continued_from`` (of ``source``; None:
    from scratch) were moved out of the run."""

    steps: list
    continued_from: int | None
    source: str | None


# ---------------------------------------------------------------------------- non-finite values (trainer/nonfinite.py)
@_kind("nonfinite")
class NonFinite(Event):
    """A NaN/Inf ``quantity`` (of ``role``) at ``step``, and what was done (``action``)."""

    step: int
    quantity: str
    role: str | None
    action: str
    count: float | None = None


@_kind("nonfinite_rollback")
class NonFiniteRollback(Event):
    """After a non-finite ``quantity`` at ``failed_step`` the run rolled back to ``restored_step``."""

    failed_step: int
    restored_step: int
    quantity: str


# ---------------------------------------------------------------------------- rollout engine (models/decode_step.py)
@_kind("decode_eager")
class DecodeEager(Event):
    """The compiled decode step failed at ``step`` and the rollout process now decodes eagerly
    (correct, slower); ``reason`` is the compiler's error."""

    step: int
    reason: str


# ---------------------------------------------------------------------------- benchmarks (bench/)
@_kind("bench_step_start")
class BenchStepStart(Event):
    """A benchmark hook's mark at the start of ``step`` (bench/recovery.py), to time phases."""

    step: int
