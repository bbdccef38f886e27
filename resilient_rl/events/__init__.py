"""Typed run events: the schema of a run folder's ``events.jsonl``, a bus, and the one reader.

Every event the trainer records (failures, recoveries, checkpoints, the run's lease, non-finite
values) is a small frozen dataclass, one per kind (:mod:`resilient_rl.events.kinds`), registered in
:data:`EVENT_TYPES` under its kind. :func:`make_event` builds one from an emitter's keyword fields and refuses a field the kind
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
:class:`~resilient_rl.run.folder.RunDir` owns one as ``run_dir.bus``.
"""

from resilient_rl.events.io import EventBus, event_to_json, events_path, make_event, parse_event, read_events
from resilient_rl.events.kinds import (ENVELOPE, EVENT_TYPES, SCHEMA_VERSION, AnyEvent, Event, EventSchemaError,
                                       UnknownEvent)

__all__ = ["ENVELOPE", "EVENT_TYPES", "SCHEMA_VERSION", "AnyEvent", "Event", "EventBus", "EventSchemaError",
           "UnknownEvent", "event_to_json", "events_path", "make_event", "parse_event", "read_events"]
