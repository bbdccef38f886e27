"""A thread that sees a signal even while the main thread cannot act on it.

Python runs a signal's handler in the main thread, between two of its bytecodes. A main thread
inside a native call that does not return on a signal never gets there: a call into Ray's
control plane once it is gone (a preemption with no warning signals Ray's processes too) blocks
until Ray ends the process, 60 s later with exit code 1 and nothing recorded. Ray's own waits
(``ray.get``, ``ray.wait``) are not such calls: they run the handlers at once.

:class:`SignalWatch` is told of every signal at the C level, through Python's wakeup fd
(:func:`signal.set_wakeup_fd`), in a thread of its own. When a watched signal has not been acted
on (:meth:`SignalWatch.handled`) within ``within_s``, it calls ``when_stuck(name)`` with the main thread's stack
logged, and exits the process with the code it was given.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Callable

logger = logging.getLogger(__name__)


def exit_now(code: int) -> None:
    """End the process with ``code`` at once (no interpreter shutdown, which can block on the same
    call as the main thread), the log and the console flushed first."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 -- a closed stream: nothing to flush
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main_thread_stack() -> str:
    """Where the main thread is now (for the log: which call does not return)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(not known)\n"


class SignalWatch:
    """Watches ``signals`` from :meth:`start` to :meth:`stop`. Where the main thread has not acted
    on one (:meth:`handled`) within ``within_s``, ``when_stuck(name)`` ends the run and returns the
    line to print before the process exits with ``code``."""

    def __init__(self, signals: tuple[int, ...], when_stuck: Callable[[str], str], code: int,
                 within_s: float) -> None:
        self.signals = frozenset(int(s) for s in signals)
        self.when_stuck, self.code, self.within_s = when_stuck, code, within_s
        self.acted = threading.Event()  # set by the main thread's handler (see :meth:`handled`)
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1

    def start(self) -> None:
        """Watch from now on; call it from the main thread, with the signals' Python handlers set."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C-level handler must never block
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), name="rrl-signal-watch", daemon=True).start()

    def handled(self) -> None:
        """The main thread acted on a watched signal (its handler ran)."""
        self.acted.set()

    def stop(self) -> None:
        """Stop watching (main thread): the wakeup fd that was there before comes back."""
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for sock in self._sockets:
            sock.close()  # the reader's recv ends, and the thread with it
        self._sockets = None

    def _watch(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            names = [signal.Signals(n).name for n in data if n in self.signals]
            if names and not self.acted.wait(self.within_s):
                self._end(names[0])

    def _end(self, name: str) -> None:
        logger.warning("%s received, and the main thread did not act on it within %g s: it is in a call that does "
                       "not return on a signal (a call into Ray's control plane, gone with the job, returns only "
                       "when Ray ends the process, 60 s later). Ending the run from here. The main thread is in:\n%s",
                       name, self.within_s, main_thread_stack())
        try:
            line = self.when_stuck(name)
        except Exception as exc:  # noqa: BLE001 -- the process ends either way; say what was not recorded
            logger.exception("recording the run's end after %s failed", name)
            line = f"{name} received with the main thread stuck; recording the run's end failed: {exc}"
        print(f"resilient-rl: {line}", file=sys.stderr)
        exit_now(self.code)
