"""A thread that sees a signal even while the main thread cannot act on it.

Python runs a signal's handler in the main thread, between two of its bytecodes. A main thread
inside a native call that does not return on a signal never gets there: a call into Ray's
control plane once it is gone (a preemption with no warning signals Ray's processes too) blocks
until Ray ends the process, 60 s later with exit code 1 and nothing recorded. Ray's own waits
(``ray.get``, ``ray.wait``) are not such calls: they run the handlers at once.

:class:`SignalWatch` is told of every signal at the C level, through Python's wakeup fd
(:func:`signal.set_wakeup_fd`), in a thread of its own. Once a watched signal arrived, the main
thread must keep acting on signals until the run's end is recorded: on that one, then on a
signal the watch sends it every second (:data:`POKE`; a wait in ``ray.get``, a sleep or a lock
answers at once). Where it does not, the watch calls ``when_stuck(name)`` with the main
thread's stack logged, and exits the process with the code it was given.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
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


#: What the watch sends the main thread to ask whether it still acts on signals (its default
#: action is to ignore it; its handler only counts the answer), and how often.
POKE = signal.SIGURG
POKE_EVERY_S = 1.0


class SignalWatch:
    """Watches ``signals`` from :meth:`start` to :meth:`stop`. Once one arrived, the main thread
    must act on it (:meth:`handled`) within ``within_s``, and then answer a :data:`POKE` (every
    :data:`POKE_EVERY_S`) within ``within_s`` until the run's end is recorded (:meth:`ended`).
    Where it does not, ``when_stuck(name)`` ends the run and returns the line to print before the
    process exits with ``code``. The pokes cover the main thread that acted on the signal and then
    entered a call that does not return on one, before it could record the end."""

    def __init__(self, signals: tuple[int, ...], when_stuck: Callable[[str], str], code: int,
                 within_s: float) -> None:
        self.signals = frozenset(int(s) for s in signals)
        self.when_stuck, self.code, self.within_s = when_stuck, code, within_s
        # Counted by the main thread's handlers: a plain int, no lock a handler could re-enter.
        self.answers = 0
        self._ended = threading.Event()
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._previous_poke = None

    def start(self) -> None:
        """Watch from now on; call it from the main thread, with the signals' Python handlers set."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C-level handler must never block
        self._previous_poke = signal.signal(POKE, self.handled)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), name="rrl-signal-watch", daemon=True).start()

    def handled(self, *_signal) -> None:
        """The main thread acted on a watched signal (its handler ran), or answered a poke (this is
        the poke's handler)."""
        self.answers += 1

    def ended(self) -> None:
        """The run's end is recorded: no more pokes, nothing left to end from here."""
        self._ended.set()

    def stop(self) -> None:
        """Stop watching (main thread): the wakeup fd and the poke's handler that were there before
        come back."""
        self._ended.set()
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(POKE, self._previous_poke if self._previous_poke is not None else signal.SIG_DFL)
        for sock in self._sockets:
            sock.close()  # the reader's recv ends, and the thread with it
        self._sockets = None

    def _watch(self, reader: socket.socket) -> None:
        name = self._first_signal(reader)
        if name is None:
            return
        main, seen = threading.main_thread().ident, 0  # the signal's own handler is the first answer
        while self._answered(seen):
            if self._ended.wait(min(POKE_EVERY_S, self.within_s)):
                return
            seen = self.answers
            try:
                signal.pthread_kill(main, POKE)
            except (OSError, ValueError):  # the main thread is gone: the process is ending
                return
        self._end(name)

    def _first_signal(self, reader: socket.socket) -> str | None:
        """The name of the first watched signal the wakeup fd tells of; None once it is closed."""
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return None
            if not data:
                return None
            names = [signal.Signals(n).name for n in data if n in self.signals]
            if names:
                return names[0]

    def _answered(self, seen: int) -> bool:
        """Whether the main thread answered (counted past ``seen``) within ``within_s``, or the
        run's end was recorded meanwhile."""
        deadline = time.monotonic() + self.within_s
        while self.answers == seen and not self._ended.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _end(self, name: str) -> None:
        logger.warning("%s received, and the main thread stopped acting on signals (%g s without an answer): it is "
                       "in a call that does not return on one (a call into Ray's control plane, gone with the job, "
                       "returns only when Ray ends the process, 60 s later). Ending the run from here. The main "
                       "thread is in:\n%s", name, self.within_s, main_thread_stack())
        try:
            line = self.when_stuck(name)
        except Exception as exc:  # noqa: BLE001 -- the process ends either way; say what was not recorded
            logger.exception("recording the run's end after %s failed", name)
            line = f"{name} received with the main thread stuck; recording the run's end failed: {exc}"
        print(f"resilient-rl: {line}", file=sys.stderr)
        exit_now(self.code)
