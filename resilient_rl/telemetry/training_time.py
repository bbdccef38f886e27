"""Where a run's time goes: useful, lost (by cause) and wall seconds over the run's whole life.

Effective training time ratio (ETTR) is the share of a run's wall time spent in training steps
that count: steps rolled back by a recovery do not (their replay does), nor do start-up, recovery,
the partial work of a failed step, or the time between a crashed controller and its successor.
It spans every controller of the run: each one continues the ledger its predecessor left in the
run folder (``ettr.json``, replaced atomically about once a second and at every recovery):

    {"version": 1, "wall_s": ..., "lost_s": {"died": ..., "controller": ...},
     "useful": [[step, running total of useful seconds], ...], "updated_at": <unix time>}

``useful`` keeps the newest :data:`TAIL` running totals, so the next controller can roll the
useful time back to the checkpoint it resumes from (the steps after it are trained again).
When the previous controller crashed or failed (``controller.json`` still says ``running``, or
``failed``), the time from its last ledger write to this controller's start is lost to cause
``controller``; after a clean stop (finished, interrupted, preempted) the pause is not part of the run.

Lost seconds of a failure (cause as classified, e.g. ``died``, ``hang``) are the failed step's
work up to the failure, the recovery itself and the steps the restore rolled back. A step in
flight counts as useful up to :data:`INFLIGHT_CREDIT` times the slowest recent step, so goodput
and ETTR fall while a step hangs instead of staying where the last finished step left them
(before this controller finished a step there is nothing to compare with: it counts in full).
The ratios are read by the exporter's thread on every scrape; one lock keeps them consistent
with the training loop's updates.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from resilient_rl.telemetry.goodput import UsefulTime

logger = logging.getLogger(__name__)

LEDGER_NAME = "ettr.json"
VERSION = 1
#: Running totals of useful time kept in the ledger (a resume rolls back at most this far exactly).
TAIL = 512
#: A step in flight counts as useful up to this multiple of the slowest of the recent steps.
INFLIGHT_CREDIT = 2.0
#: Controller states after which the pause before the next controller is lost time.
UNCLEAN_ENDS = ("running", "failed")


def read_ledger(run_path: str | os.PathLike[str]) -> dict | None:
    """The run folder's ledger, or None when there is none; an unreadable one is reported and
    ignored (ETTR then restarts from this controller: telemetry must not stop a run)."""
    path = Path(run_path) / LEDGER_NAME
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {VERSION}")
        ledger = {"wall_s": float(data["wall_s"]), "updated_at": float(data["updated_at"]),
                  "lost_s": {str(k): float(v) for k, v in data["lost_s"].items()},
                  "useful": [(int(s), float(t)) for s, t in data["useful"]]}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("%s is unreadable (%s): ETTR starts over from this controller", path, exc)
        return None
    return ledger


def write_ledger(run_path: str | os.PathLike[str], ledger: dict) -> None:
    """Replace the run folder's ledger atomically (a reader never sees half of one)."""
    path = Path(run_path) / LEDGER_NAME
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": VERSION, **ledger}))
    os.replace(tmp, path)


class TrainingTime:
    """Live accounting of one controller, continuing the run's ledger.

    Args:
        run_path: the run folder (None: nothing is read or written, e.g. in unit tests).
        previous_state: the state of the previous controller's ``controller.json`` (None: none).
        on_lost: called with ``(cause, seconds)`` whenever seconds are lost (metrics).
        clock, wall_clock: monotonic and Unix time, replaced by fakes in tests.
        write_interval_s: least time between two ledger writes of finished steps.
    """

    def __init__(self, run_path: str | os.PathLike[str] | None, previous_state: str | None = None,
                 on_lost: Callable[[str, float], None] = lambda cause, seconds: None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 write_interval_s: float = 1.0) -> None:
        self.run_path = run_path
        self.clock, self.wall_clock = clock, wall_clock
        self.on_lost = on_lost
        self.write_interval_s = write_interval_s
        ledger = read_ledger(run_path) if run_path is not None else None
        self.useful = UsefulTime()          # the run's whole life
        self.useful_here = UsefulTime()     # this controller's steps (goodput)
        self.lost: dict[str, float] = {}
        self.wall_before = 0.0
        self._previous = ledger if previous_state in UNCLEAN_ENDS else None
        if ledger is not None:
            self.useful.seed(ledger["useful"])
            self.lost = dict(ledger["lost_s"])
            self.wall_before = ledger["wall_s"]
        self.started: float | None = None
        self._inflight_since: float | None = None
        self._failure: tuple[str, float] | None = None  # (cause, when) of the recovery under way
        self._replay: tuple[int, float] | None = None   # (failed step, recovered at) until it is done
        self._recent: deque[float] = deque(maxlen=16)
        self._written_at: float | None = None
        self._lock = threading.RLock()  # the scrape thread reads what the training loop updates
        # Written only once the workers are up: a controller refused by the run's lease (it starts
        # its exporter first) must not overwrite the live controller's ledger.
        self._owns_ledger = False

    # ------------------------------------------------------------------ events
    def start(self) -> None:
        """This controller's wall clock starts (idempotent); a crashed predecessor's pause is lost."""
        with self._lock:
            if self.started is not None:
                return
            self.started = self.clock()
            if self._previous is not None:
                gap = max(0.0, self.wall_clock() - self._previous["updated_at"])
                self.wall_before += gap
                self._lose("controller", gap)

    def steps_resume(self) -> None:
        """Workers are up (after start or a recovery): the next step is in flight from now, and
        this controller, which holds the run by now, keeps the ledger."""
        with self._lock:
            self._inflight_since = self.clock()
            if not self._owns_ledger:
                self._owns_ledger = True
                self.save(force=True)

    def step_done(self, step: int, seconds: float) -> float | None:
        """Step ``step`` finished in ``seconds``; returns the replay phase's seconds when this step
        completes the step a recovery failed at, else None."""
        with self._lock:
            now = self.clock()
            dropped = self.useful.record(step, seconds)
            self.useful_here.record(step, seconds)
            self._lose("controller", dropped)  # a resumed run re-trains its predecessor's last steps
            self._recent.append(seconds)
            self._inflight_since = now
            replay = None
            if self._replay is not None and step >= self._replay[0]:
                replay, self._replay = now - self._replay[1], None
            self.save()
            return replay

    def failed(self, cause: str) -> None:
        """A step failed and recovery starts: the failed step's work so far is lost."""
        with self._lock:
            now = self.clock()
            if self._inflight_since is not None:
                self._lose(cause, now - self._inflight_since)
            self._inflight_since, self._replay = None, None
            if self._failure is None:
                self._failure = (cause, now)

    def recovered(self, failed_step: int, restored_step: int) -> None:
        """Recovery finished: it and the steps it rolled back are lost to the failure's cause."""
        with self._lock:
            now = self.clock()
            cause, since = self._failure if self._failure is not None else ("unknown", now)
            self._failure = None
            self._lose(cause, now - since)
            self.rolled_back(restored_step, cause)
            self._inflight_since = now
            self._replay = (failed_step, now)
            self.save(force=True)

    def rolled_back(self, step: int, cause: str) -> None:
        """The run went back to ``step`` (the steps after it are trained again)."""
        with self._lock:
            self.useful_here.rollback(step)
            self._lose(cause, self.useful.rollback(step))

    def close(self) -> None:
        """The controller stops: a recovery still under way (aborted) is lost; the ledger is written."""
        with self._lock:
            if self.started is None:
                return
            if self._failure is not None:
                cause, since = self._failure
                self._failure = None
                self._lose(cause, self.clock() - since)
            self._inflight_since = None
            self.save(force=True)

    # ------------------------------------------------------------------ ratios
    def _credit(self, now: float) -> float:
        since = self._inflight_since
        if since is None:
            return 0.0
        elapsed = max(0.0, now - since)
        recent = list(self._recent)
        return min(elapsed, INFLIGHT_CREDIT * max(recent)) if recent else elapsed

    def ettr(self) -> float | None:
        """Useful over wall seconds of the run's whole life; None before this controller started."""
        with self._lock:
            if self.started is None:
                return None
            now = self.clock()
            wall = self.wall_before + (now - self.started)
            return min(1.0, (self.useful.total + self._credit(now)) / wall) if wall > 0 else None

    def goodput(self) -> float | None:
        """Useful over wall seconds of this controller; None before it started."""
        with self._lock:
            if self.started is None:
                return None
            now = self.clock()
            wall = now - self.started
            return min(1.0, (self.useful_here.total + self._credit(now)) / wall) if wall > 0 else None

    # ------------------------------------------------------------------ ledger
    def _lose(self, cause: str, seconds: float) -> None:
        if seconds > 0:
            self.lost[cause] = self.lost.get(cause, 0.0) + seconds
            self.on_lost(cause, seconds)

    def ledger(self) -> dict:
        """What :func:`write_ledger` persists now."""
        with self._lock:
            wall = self.wall_before + (self.clock() - self.started if self.started is not None else 0.0)
            return {"wall_s": wall, "lost_s": dict(self.lost), "useful": self.useful.tail(TAIL),
                    "updated_at": self.wall_clock()}

    def save(self, force: bool = False) -> None:
        """Write the ledger (at most every ``write_interval_s`` unless ``force``); never raises."""
        with self._lock:
            if self.run_path is None or self.started is None or not self._owns_ledger:
                return
            now = self.clock()
            if not force and self._written_at is not None and now - self._written_at < self.write_interval_s:
                return
            try:
                write_ledger(self.run_path, self.ledger())
                self._written_at = now
            except OSError as exc:
                logger.warning("cannot write %s in %s: %s", LEDGER_NAME, self.run_path, exc)

