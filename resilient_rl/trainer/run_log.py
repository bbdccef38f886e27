"""Console and log-file output of a run: a clean progress bar, the full log in ``train.log``.

The console gets short lines that never tear the progress bar (they go through ``tqdm.write``);
the run folder's ``train.log`` gets everything: every logged message at INFO and above, one
line per step with all its metrics (the :data:`STEP_LOG` logger, which is kept off the console),
the stdout/stderr of the Ray workers and the errors Ray reports to the driver ("A worker died or
was killed ...", tagged ``(raylet)``) (the :data:`WORKER_LOG` logger), which Ray would otherwise
print into the driver's terminal.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from resilient_rl.config.secrets import RedactingFilter

#: One line per step with every metric; written to ``train.log`` only.
STEP_LOG = logging.getLogger("resilient_rl.steps")
#: Lines printed by Ray workers (and the raylet); written to ``train.log`` only.
WORKER_LOG = logging.getLogger("resilient_rl.worker_output")
#: Ray notices moved off the console into ``train.log`` (they are informational for a local run).
QUIET_RAY_LOGGERS = ("ray._private.authentication.authentication_token_setup",)

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RAY_HANDLER = "ray_print_logs"  # the name Ray registers its worker-output printer under
_OUR_HANDLER = "resilient_rl_worker_output"
_RAY_ERROR_PRINTER = "print_to_stdstream"  # what Ray's error-listener thread calls, looked up per message
_SAVED_ERROR_PRINTER = "_resilient_rl_saved_print_to_stdstream"
for _quiet in (STEP_LOG, WORKER_LOG):
    _quiet.propagate = False
    _quiet.setLevel(logging.INFO)


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
    """Log to stderr at ``level`` through tqdm; the root logger lets INFO through for ``train.log``."""
    handler = TqdmConsoleHandler()
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
        return [logging.getLogger(), STEP_LOG, WORKER_LOG, *(logging.getLogger(n) for n in QUIET_RAY_LOGGERS)]

    def __enter__(self) -> "RunLog":
        handler, depth = self._open.get(self.path, (None, 0))
        if handler is None:
            handler = logging.FileHandler(self.path, mode="a", encoding="utf-8")
            handler.setLevel(logging.INFO)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler.addFilter(RedactingFilter())  # no credential reaches the file, however it was logged
            for lg in self._loggers():
                lg.addHandler(handler)
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
        if not self._open:
            for name in QUIET_RAY_LOGGERS:
                logging.getLogger(name).propagate = True
        handler.close()


def _handler_names(dispatcher) -> list[str]:
    """Names registered on Ray's dispatcher (a list of ``(name, callback)`` pairs in Ray 2.x)."""
    try:
        return [name for name, _ in getattr(dispatcher, "handlers", [])]
    except (TypeError, ValueError):
        return []


def _log_worker_lines(data: dict) -> None:
    """Ray's worker-output callback: one ``train.log`` line per printed line, tagged with its process."""
    lines = data.get("lines", ())
    if data.get("pid") == "autoscaler":
        # Ray prints only the autoscaler's event lines ("Adding 1 node"), not its periodic status.
        try:
            from ray._private.worker import filter_autoscaler_events
        except ImportError:
            return
        lines = filter_autoscaler_events(lines)
    who = data.get("actor_name") or data.get("task_name") or ""
    tag = f"({who} pid={data.get('pid')}, {data.get('ip')})" if data.get("pid") not in ("raylet", "autoscaler") \
        else f"({data.get('pid')})"
    if not RunLog._open:  # no run log open (Ray used outside a run): print as Ray would
        from tqdm import tqdm

        for line in lines:
            tqdm.write(f"{tag} {line}", file=sys.stderr if data.get("is_err") else sys.stdout)
        return
    level = logging.WARNING if data.get("is_err") else logging.INFO
    for line in lines:
        WORKER_LOG.log(level, "%s %s", tag, line)


def _log_ray_error(data: dict, ignore_prefix: bool = False) -> None:
    """Stands in for Ray's ``print_to_stdstream`` in its error-listener thread: a warning in ``train.log``.

    Ray's driver prints the errors the cluster publishes (a worker that died, a task that failed)
    to stdout. The controller reports a failure itself, on the console, when a call meets it.
    """
    _log_worker_lines({**data, "is_err": True})


def _capture_ray_errors(ray_worker) -> None:
    """Swap the module-level printer Ray's error listener calls (once; :func:`release_worker_output` undoes it)."""
    current = getattr(ray_worker, _RAY_ERROR_PRINTER, None)
    if current is None or current is _log_ray_error:
        return
    setattr(ray_worker, _SAVED_ERROR_PRINTER, current)
    setattr(ray_worker, _RAY_ERROR_PRINTER, _log_ray_error)


def capture_worker_output() -> bool:
    """Route the Ray workers' stdout/stderr and Ray's error notices into :data:`WORKER_LOG`.

    Needs ``ray.init(log_to_driver=True)``. Ray has no public hook for this, so it swaps the printer
    Ray registers on its log dispatcher, and the printer its error-listener thread calls; returns
    False (Ray keeps printing the workers' output) if the dispatcher's printer is not there.
    """
    try:
        from ray._private import worker as ray_worker
    except ImportError:
        return False
    _capture_ray_errors(ray_worker)
    dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
    if dispatcher is None or not all(hasattr(dispatcher, a) for a in ("add_handler", "remove_handler")):
        return False
    names = _handler_names(dispatcher)
    if _RAY_HANDLER not in names:
        return False
    dispatcher.remove_handler(_RAY_HANDLER)
    if _OUR_HANDLER not in names:
        dispatcher.add_handler(_OUR_HANDLER, _log_worker_lines)
    return True


def release_worker_output() -> None:
    """Undo :func:`capture_worker_output` (the next ``ray.init`` registers Ray's own printer again)."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:
        return
    saved = getattr(ray_worker, _SAVED_ERROR_PRINTER, None)
    if saved is not None:
        setattr(ray_worker, _RAY_ERROR_PRINTER, saved)
        delattr(ray_worker, _SAVED_ERROR_PRINTER)
    dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
    if dispatcher is not None and _OUR_HANDLER in _handler_names(dispatcher):
        dispatcher.remove_handler(_OUR_HANDLER)
