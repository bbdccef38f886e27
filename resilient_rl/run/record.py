"""``controller.json`` in the run folder: which process drives the run, and how it ended.

The controller writes the record when ``fit`` starts (pid, hostname, process start time, state
``running``), notes the step it starts from once the roles are up (a resumed run starts past 0),
and marks it ``finished``, ``failed`` (with the reason), ``interrupted`` (Ctrl-C) or
``preempted`` (SIGTERM/SIGUSR1, after its last step was made durable) when ``fit`` returns or
raises. A record still saying ``running`` whose process is gone means the controller died
without a clean exit; ``resilient-rl status`` tells the two apart with :func:`controller_alive`.

Every write replaces the file atomically, so a reader never sees half a record.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import psutil

from resilient_rl.errors import Preempted

CONTROLLER_NAME = "controller.json"
#: States a record can be in; only ``running`` can change.
STATES = ("running", "finished", "failed", "interrupted", "preempted")
# A pid whose process started later than the record's own start time (plus clock slack) was reused.
_CREATE_TIME_SLACK_S = 2.0
# A run's end is marked once, by the main thread or by the thread that ends a stuck one.
_ENDING = threading.Lock()


@dataclass
class ControllerRecord:
    """The controller process of one ``fit`` of a run."""

    pid: int
    host: str
    process_started_at: float   # the process's creation time (Unix), to recognise a reused pid
    started_at: float           # when fit began: goodput's wall clock starts here, as telemetry's does
    state: str = "running"
    start_step: int | None = None   # the step fit continued from (after a resume); None until known
    ended_at: float | None = None
    end_step: int | None = None
    reason: str | None = None

    @classmethod
    def for_this_process(cls) -> "ControllerRecord":
        pid = os.getpid()
        return cls(pid=pid, host=socket.gethostname(), process_started_at=psutil.Process(pid).create_time(),
                   started_at=time.time())

    def write(self, run_path: str | os.PathLike[str]) -> None:
        path = Path(run_path) / CONTROLLER_NAME
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)

    def end(self, run_path: str | os.PathLike[str], state: str, step: int, reason: str | None = None) -> bool:
        """Mark the run's ``fit`` as over in ``state`` at ``step``; once: False (and nothing
        written) when it is marked already, by another thread ending a stuck main thread's run
        (:mod:`resilient_rl.trainer.signal_watch`) whose main thread then got out."""
        with _ENDING:
            if self.state != "running":
                return False
            self.state, self.end_step, self.reason, self.ended_at = state, step, reason, time.time()
            self.write(run_path)
            return True


def read_controller_record(run_path: str | os.PathLike[str]) -> ControllerRecord | None:
    """The run folder's record, or None if there is none or it is not a record this code wrote."""
    path = Path(run_path) / CONTROLLER_NAME
    try:
        data = json.loads(path.read_text())
        record = ControllerRecord(**data)
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None
    return record if record.state in STATES else None


def controller_alive(record: ControllerRecord) -> bool | None:
    """Whether the recorded controller process still runs: None when it ran on another host."""
    if record.host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(record.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return proc.create_time() <= record.process_started_at + _CREATE_TIME_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # access denied: the process exists
        return True


@contextmanager
def controller_session(run_path: str | os.PathLike[str], step: Callable[[], int]) -> Iterator[ControllerRecord]:
    """Record this process as the run's controller for the ``with`` block; mark how it ended."""
    record = ControllerRecord.for_this_process()
    record.write(run_path)
    try:
        yield record
    except KeyboardInterrupt:
        record.end(run_path, "interrupted", step())
        raise
    except Preempted as exc:
        record.end(run_path, "preempted", step(), str(exc))
        raise
    except BaseException as exc:
        record.end(run_path, "failed", step(), f"{type(exc).__name__}: {exc}")
        raise
    record.end(run_path, "finished", step())
