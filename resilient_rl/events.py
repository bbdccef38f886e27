"""Typed run events: the schema of a run folder's ``events.jsonl``, a bus, and the one reader.

Every event the trainer records (failures, recoveries, checkpoints, the run's lease, non-finite
values) is a small frozen dataclass, one per kind, registered in :data:`EVENT_TYPES` under its
kind. :func:`make_event` builds one from an emitter's keyword fields and refuses a field the kind
does not have, or a missing one, with an :class:`EventSchemaError` naming both, so an emitter that
drifts from its type fails at once (in tests, not in a reader months later). Field types are
documented by the annotations and not checked: values only have to be JSON-serializable.

On disk each event is one JSON line (see :func:`event_to_json`)::

    {"event": "failure", "v": 1, "time": 1700000000.5, "step": 4, "role": ..., ...}

``v`` is :data:`SCHEMA_VERSION`; every field of the kind is written, ``null`` for an optional
one not given. Changing the fields of a kind (adding one included) bumps :data:`SCHEMA_VERSION`;
adding a new kind does not.

Reading (:func:`parse_event`, :func:`read_events`) has to cope with folders written by other
versions of the code, e.g. ``resilient-rl status`` of a run that a newer trainer is writing:

- a line of an unknown kind, or of a newer version than this code knows, is kept as an
  :class:`UnknownEvent` (its fields as written, unchecked): a reader shows what it understands
  and skips the rest, it never fails on a newer run folder;
- a line without ``v`` was written before events were versioned: it is read as version 1 (the
  fields were the same); one that does not fit its kind's fields is kept as an UnknownEvent with
  a warning;
- a line of a known kind and version whose fields do not match is damage: EventSchemaError
  (:func:`read_events` raises it as a RunFolderError naming the file and line).

:class:`EventBus` carries events from the writer to its subscribers (the experiment trackers);
:class:`~resilient_rl.trainer.run_dir.RunDir` owns one as ``run_dir.bus``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Union

from resilient_rl.errors import RRLError, RunFolderError
from resilient_rl.jsonl import numbered_rows

logger = logging.getLogger(__name__)

#: Version of the line format and of every kind's fields; written as ``v`` on every line.
SCHEMA_VERSION = 1
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
    """A worker process came back (Ray restarted it) during a recovery: ``role`` is the role it
    is reported under (the first of the roles sharing it), ``cause`` the failure's cause."""

    role: str | None = None
    cause: str | None = None


@_kind("kill_unresponsive")
class KillUnresponsive(_WorkerEvent):
    """The controller killed a worker that did not answer its health probe (stopped)."""


@_kind("kill_hung")
class KillHung(_WorkerEvent):
    """The controller killed a worker that answered but stopped advancing inside a call."""

    reason: str


# ---------------------------------------------------------------------------- recovery (trainer/resilience.py)
@_kind("failure")
class FailureEvent(Event):
    """Step ``step`` failed; recovery starts. ``role`` and ``rank`` name the failing worker's role
    (``actor``, ``critic``, ...), ``group`` its process group where known (older runs: none, and
    ``role`` may hold a worker-group name); ``cause`` is a
    :class:`~resilient_rl.controller.recovery.Cause` value."""

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


@_kind("recovered")
class Recovered(Event):
    """Recovery finished: restored ``restored_step``, replays from there; ``restarted`` lists the
    restarted workers as ``[group, rank]``; ``generation`` is the new process-group generation."""

    failed_step: int
    restored_step: int
    steps_replayed: int
    duration_s: float
    restarted: list
    generation: int


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


# ---------------------------------------------------------------------------- benchmarks (bench/)
@_kind("bench_step_start")
class BenchStepStart(Event):
    """A benchmark hook's mark at the start of ``step`` (bench/recovery.py), to time phases."""

    step: int


# ---------------------------------------------------------------------------- building and parsing
def _field_names(cls: type[Event]) -> tuple[list[str], set[str]]:
    """(every field but ``time``, the required ones) of ``cls``."""
    fs = [f for f in dataclasses.fields(cls) if f.name != "time"]
    required = {f.name for f in fs if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return [f.name for f in fs], required


def _check_fields(cls: type[Event], fields: dict[str, Any]) -> None:
    names, required = _field_names(cls)
    unknown = [k for k in fields if k not in names]
    missing = [k for k in names if k in required and k not in fields]
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
        if missing:
            parts.append(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        raise EventSchemaError(f"event {cls.kind!r}: {' and '.join(parts)} (its fields: {', '.join(names)})")


def make_event(kind: str, *, time: float | None = None, **fields: Any) -> Event:
    """The typed event ``kind`` with ``fields`` (at ``time``, default now).

    Raises:
        EventSchemaError: ``kind`` is unknown, or a field is unknown or missing (names them)."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise EventSchemaError(f"unknown event kind {kind!r}; known kinds: {', '.join(sorted(EVENT_TYPES))}")
    _check_fields(cls, fields)
    return cls(time=_time.time() if time is None else time, **fields)


def event_to_json(ev: AnyEvent) -> dict[str, Any]:
    """The line of ``ev``: ``event``, ``v``, ``time``, then every field (an UnknownEvent as read)."""
    if isinstance(ev, UnknownEvent):
        head = {"event": ev.kind, "time": ev.time} if ev.version is None else \
            {"event": ev.kind, "v": ev.version, "time": ev.time}
        return {**head, **ev.data}
    return {"event": ev.kind, "v": SCHEMA_VERSION, "time": ev.time, **ev.payload()}


def parse_event(obj: dict[str, Any]) -> AnyEvent:
    """The event of one line (see the module docstring for other versions and unknown kinds).

    Raises:
        EventSchemaError: not an event line (no kind, no time, a bad version), or a known kind of a
        known version whose fields do not match its type (names the field)."""
    if not isinstance(obj, dict):
        raise EventSchemaError(f"an event is a JSON object, not {type(obj).__name__}")
    kind = obj.get("event")
    if not isinstance(kind, str) or not kind:
        raise EventSchemaError(f"no event kind (\"event\") in {_short(obj)}")
    version = obj.get("v")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise EventSchemaError(f"event {kind!r}: bad schema version v={version!r}")
    t = obj.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise EventSchemaError(f"event {kind!r}: no numeric \"time\" in {_short(obj)}")
    data = {k: v for k, v in obj.items() if k not in ENVELOPE}
    cls = EVENT_TYPES.get(kind)
    if cls is None or (version is not None and version > SCHEMA_VERSION):
        return UnknownEvent(kind=kind, time=t, version=version, data=data)
    try:
        _check_fields(cls, data)
    except EventSchemaError as exc:
        if version is not None:
            raise
        logger.warning("an unversioned event line does not fit its type, kept unchecked: %s", exc)
        return UnknownEvent(kind=kind, time=t, version=None, data=data)
    return cls(time=t, **data)


def _short(obj: Any, n: int = 200) -> str:
    text = repr(obj)
    return text if len(text) <= n else text[:n] + "..."


def events_path(source: Any) -> Path:
    """``events.jsonl`` of a RunDir (its ``events_path``), of a run folder, or the file itself."""
    given = getattr(source, "events_path", None)
    if given is not None:
        return Path(given)
    path = Path(source)
    return path / "events.jsonl" if path.is_dir() else path


def read_events(source: Any, *, typed: bool = False) -> list:
    """Every event of a run folder's ``events.jsonl`` (``source``: see :func:`events_path`; none
    when the file is absent), in order.

    By default each is a dict: a known event normalized as written by :func:`event_to_json`
    (every field present), an :class:`UnknownEvent` as the line was written. ``typed=True``
    returns the events (:func:`parse_event`). A torn last line (a writer killed mid-append, or an
    append in progress) is skipped with a warning.

    Raises:
        RunFolderError: a line that is not JSON, or not an event of its kind (names file and line)."""
    path = events_path(source)
    out = []
    for lineno, obj in numbered_rows(path):
        try:
            ev = parse_event(obj)
        except EventSchemaError as exc:
            raise RunFolderError(f"{path}: line {lineno}: {exc}") from None
        if typed:
            out.append(ev)
        else:
            out.append(obj if isinstance(ev, UnknownEvent) else event_to_json(ev))
    return out


# ---------------------------------------------------------------------------- the bus
class EventBus:
    """Publishes events to subscribers, in the order they subscribed.

    A subscriber that raises is logged and skipped: it never breaks the publisher (recovery emits
    most events, and a tracker's hiccup must not stop it) nor the other subscribers."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[AnyEvent], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Callable[[AnyEvent], None]) -> Callable[[], None]:
        """Call ``fn(event)`` on every later event; returns a function that unsubscribes (idempotent)."""
        def call(ev: AnyEvent) -> None:  # a distinct entry per subscription, even of the same ``fn``
            fn(ev)

        with self._lock:
            self._subscribers.append(call)

        def unsubscribe() -> None:
            with self._lock:
                if call in self._subscribers:
                    self._subscribers.remove(call)

        return unsubscribe

    def publish(self, event: AnyEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for call in subscribers:
            try:
                call(event)
            except Exception:
                logger.exception("an event subscriber failed on a %r event (the event is recorded; "
                                 "the other subscribers still get it)", event.kind)
