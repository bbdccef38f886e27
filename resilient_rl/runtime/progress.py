"""Progress of a worker process: which call it is in and when it last advanced.

A slow step is not a hang. Every ``@register``-ed call marks :func:`begin` / :func:`end` (the
``register`` wrapper does it, in the worker process), and the loops that make progress call
:func:`advance` (a mini-batch done, a block of tokens generated, a checkpoint chunk written). The
worker's health reply, answered from its health concurrency group even while a call runs, carries
:func:`snapshot`; the controller calls a rank hung when it is inside a call and has not advanced
for ``recovery.hang_timeout_s``, however long the call is (see :mod:`resilient_rl.runtime.liveness`).

The tracker is per process (colocated roles share one), because a process is what hangs and what
gets killed. :func:`advance` is on hot paths: a monotonic clock read and two attribute stores; it
takes no lock (CPython makes each store atomic, and a reader that sees a slightly stale pair is
harmless: the age it computes is off by one advance at most).

:func:`slow_down` is a fault injector for the chaos suite: the next ``n`` advances each sleep
first, so a call becomes slow while staying healthy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressSnapshot:
    """What a health reply says about progress.

    ``call`` is the registered call the process is in (None when idle), ``age_s`` the seconds since
    it last advanced (or began the call), ``advances`` a counter that only grows."""

    call: str | None
    age_s: float
    advances: int


class ProgressTracker:
    """Thread-safe begin/end of calls (nested calls count once) and a cheap ``advance``."""

    def __init__(self, clock=time.monotonic, sleep=time.sleep) -> None:
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._calls: list[str] = []
        self._last = clock()
        self._advances = 0
        self._last_what: str | None = None
        # Fault injection (chaos): seconds to sleep before each of the next ``_slow_left`` advances.
        self._slow_s = 0.0
        self._slow_left = 0

    def begin(self, call: str) -> None:
        """Enter ``call``; entering counts as progress (the call has just started)."""
        with self._lock:
            self._calls.append(call)
            self._last = self._clock()

    def end(self) -> None:
        """Leave the innermost call."""
        with self._lock:
            if self._calls:
                self._calls.pop()
            self._last = self._clock()

    def advance(self, what: str | None = None) -> None:
        """Record one unit of progress (cheap: call it from inner loops)."""
        if self._slow_left:
            self._injected_delay()
        self._last = self._clock()
        self._advances += 1
        self._last_what = what

    def _injected_delay(self) -> None:
        with self._lock:
            if self._slow_left <= 0:
                return
            self._slow_left -= 1
            delay = self._slow_s
        self._sleep(delay)

    def slow_down(self, seconds_per_advance: float, advances: int) -> None:
        """Fault injection: sleep ``seconds_per_advance`` before each of the next ``advances`` advances."""
        if seconds_per_advance < 0 or advances < 0:
            raise ValueError(f"slow_down needs seconds_per_advance >= 0 and advances >= 0, got "
                             f"{seconds_per_advance} and {advances}")
        with self._lock:
            self._slow_s, self._slow_left = float(seconds_per_advance), int(advances)

    def snapshot(self) -> ProgressSnapshot:
        """The current call (outermost), the seconds since the last advance, the advance count."""
        with self._lock:
            call = self._calls[0] if self._calls else None
        return ProgressSnapshot(call, max(0.0, self._clock() - self._last), self._advances)

    def track(self, call: str):
        """Context manager: ``with tracker.track("update_actor"): ...`` marks begin and end."""
        return _Tracked(self, call)


class _Tracked:
    __slots__ = ("tracker", "call")

    def __init__(self, tracker: ProgressTracker, call: str) -> None:
        self.tracker, self.call = tracker, call

    def __enter__(self):
        self.tracker.begin(self.call)
        return self.tracker

    def __exit__(self, *exc) -> None:
        self.tracker.end()


_TRACKER = ProgressTracker()


def tracker() -> ProgressTracker:
    """This process's tracker."""
    return _TRACKER


def begin(call: str) -> None:
    _TRACKER.begin(call)


def end() -> None:
    _TRACKER.end()


def advance(what: str | None = None) -> None:
    """Record progress of this process (a mini-batch, a token block, a collective, a chunk written)."""
    _TRACKER.advance(what)


def snapshot() -> ProgressSnapshot:
    return _TRACKER.snapshot()


def advancing(items, what: str | None = None):
    """Yield from ``items``, recording one advance per item (chunks of a file being written)."""
    for item in items:
        _TRACKER.advance(what)
        yield item


def slow_down(seconds_per_advance: float, advances: int) -> None:
    """Fault injection for this process; see :meth:`ProgressTracker.slow_down`."""
    _TRACKER.slow_down(seconds_per_advance, advances)
