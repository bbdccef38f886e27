"""Console and log-file output of a run: a clean progress bar, the full log in ``train.log``.

The console gets short lines that never tear the progress bar (they go through ``tqdm.write``);
the run folder's ``train.log`` gets everything: every logged message at INFO and above, one
line per step with all its metrics (the :data:`STEP_LOG` logger, which is kept off the console),
the stdout/stderr of the Ray workers and the errors Ray reports to the driver ("A worker died or
was killed ...", tagged ``(raylet)``) (:data:`~resilient_rl.runtime.worker_output.WORKER_LOG`), which Ray would otherwise
print into the driver's terminal.

``train.log`` is rotated at ``ROTATE_BYTES`` (``train.log.1`` the newest older part, up to
``KEEP_ROTATED`` of them): a week-long run with its per-step line and its workers' output would
otherwise grow it without bound.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

from resilient_rl.config.secrets import RedactingFilter
from resilient_rl.log_route import ConsoleFilter
from resilient_rl.runtime import worker_output

#: One line per step with every metric; written to ``train.log`` only.
STEP_LOG = logging.getLogger("resilient_rl.steps")
#: Ray notices moved off the console into ``train.log`` (they are informational for a local run).
QUIET_RAY_LOGGERS = ("ray._private.authentication.authentication_token_setup",)

#: ``train.log`` is rotated past this size; the newest ``KEEP_ROTATED`` older parts are kept.
ROTATE_BYTES = 100 * 2**20
KEEP_ROTATED = 9

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STEP_LOG.propagate = False
STEP_LOG.setLevel(logging.INFO)


class TqdmConsoleHandler(logging.Handler):
    """A console handler that writes through ``tqdm.write``, so an active progress bar stays whole.

    It writes to whatever ``sys.stderr`` is when a record arrives, never to a stream it kept: a
    caller that swaps stderr (a test harness, a notebook) and closes the old one loses nothing.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


def setup_console(level: int) -> None:
    """Log to stderr at ``level`` through tqdm; the root logger lets INFO through for ``train.log``.
    Routine lines marked :data:`~resilient_rl.log_route.FILE_ONLY` reach ``train.log`` only."""
    handler = TqdmConsoleHandler()
    handler.addFilter(ConsoleFilter())
    handler.addFilter(RedactingFilter())
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, TqdmConsoleHandler)] + [handler]
    root.setLevel(min(level, logging.INFO))


class RunLog:
    """Context manager that appends the whole log of a run to ``path`` (``runs/<run>/train.log``).

    Re-entrant: a nested ``RunLog`` on the same path (the CLI opens one around Ray's start-up,
    :meth:`PPOTrainer.fit` one around the loop) reuses the open file.
    """

    _open: dict[str, tuple[logging.Handler, int]] = {}

    def __init__(self, path: str | Path):
        self.path = str(Path(path).resolve())

    def _loggers(self) -> list[logging.Logger]:
        return [logging.getLogger(), STEP_LOG, *(logging.getLogger(n) for n in QUIET_RAY_LOGGERS)]

    def __enter__(self) -> "RunLog":
        handler, depth = self._open.get(self.path, (None, 0))
        if handler is None:
            handler = logging.handlers.RotatingFileHandler(self.path, mode="a", maxBytes=ROTATE_BYTES,
                                                           backupCount=KEEP_ROTATED, encoding="utf-8")
            handler.setLevel(logging.INFO)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler.addFilter(RedactingFilter())  # no credential reaches the file, however it was logged
            for lg in self._loggers():
                lg.addHandler(handler)
            worker_output.write_to(handler)
            for name in QUIET_RAY_LOGGERS:
                logging.getLogger(name).propagate = False  # off Ray's console handler, into train.log
        self._open[self.path] = (handler, depth + 1)
        return self

    def __exit__(self, *exc) -> None:
        handler, depth = self._open[self.path]
        if depth > 1:
            self._open[self.path] = (handler, depth - 1)
            return
        del self._open[self.path]
        for lg in self._loggers():
            lg.removeHandler(handler)
        worker_output.stop_writing_to(handler)
        if not self._open:
            for name in QUIET_RAY_LOGGERS:
                logging.getLogger(name).propagate = True
        handler.close()
