"""Building, writing, parsing and reading events, and the bus that carries them to subscribers."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time as _time
from pathlib import Path
from typing import Any, Callable

from resilient_rl.errors import RunFolderError
from resilient_rl.events.kinds import (ENVELOPE, EVENT_TYPES, SCHEMA_VERSION, AnyEvent, Event, EventSchemaError,
                                       UnknownEvent)
from resilient_rl.jsonl import numbered_rows

logger = logging.getLogger(__name__)


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
    try:
        return cls(time=_time.time() if time is None else time, **fields)
    except TypeError:  # an unknown or missing field: named by the check
        _check_fields(cls, fields)
        raise


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
        self._subscribers: list[list] = []  # [fn, kinds]: a distinct entry per subscription
        self._lock = threading.Lock()

    def subscribe(self, fn: Callable[[AnyEvent], None], *kinds: type[Event]) -> Callable[[], None]:
        """Call ``fn(event)`` on every later event (only those of the event types ``kinds``, where
        given); returns a function that unsubscribes (idempotent)."""
        entry = [fn, kinds]  # a distinct entry per subscription, even of the same ``fn``
        with self._lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = [e for e in self._subscribers if e is not entry]

        return unsubscribe

    def publish(self, event: AnyEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for call, kinds in subscribers:
            if kinds and not isinstance(event, kinds):
                continue
            try:
                call(event)
            except Exception:
                logger.exception("an event subscriber failed on a %r event (the event is recorded; "
                                 "the other subscribers still get it)", event.kind)
