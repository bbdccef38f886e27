"""The Ray workers' stdout/stderr and Ray's error notices, routed into one logger.

Ray prints what its workers write, and the errors the cluster publishes ("A worker died or was
killed ..."), into the driver's terminal, where they would tear the run's progress bar.
:func:`capture_worker_output` routes both into :data:`WORKER_LOG`, which the run's log
(:class:`~resilient_rl.run.log.RunLog`) writes to ``train.log``; with no run log open they are
printed as Ray would.
"""

from __future__ import annotations

import logging
import sys

#: Lines printed by Ray workers (and the raylet); written to ``train.log`` only.
WORKER_LOG = logging.getLogger("resilient_rl.worker_output")
WORKER_LOG.propagate = False
WORKER_LOG.setLevel(logging.INFO)

#: The run logs' file handlers writing :data:`WORKER_LOG` (see :func:`write_to`); none: print.
_RUN_LOGS: list[logging.Handler] = []

_RAY_HANDLER = "ray_print_logs"  # the name Ray registers its worker-output printer under
_OUR_HANDLER = "resilient_rl_worker_output"
_RAY_ERROR_PRINTER = "print_to_stdstream"  # what Ray's error-listener thread calls, looked up per message
_SAVED_ERROR_PRINTER = "_resilient_rl_saved_print_to_stdstream"


def write_to(handler: logging.Handler) -> None:
    """Write the workers' lines to ``handler`` (a run's ``train.log``) instead of printing them."""
    _RUN_LOGS.append(handler)
    WORKER_LOG.addHandler(handler)


def stop_writing_to(handler: logging.Handler) -> None:
    """Undo :func:`write_to`; with no run log left, the workers' lines are printed again."""
    if handler in _RUN_LOGS:
        _RUN_LOGS.remove(handler)
    WORKER_LOG.removeHandler(handler)


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
    if not _RUN_LOGS:  # no run log open (Ray used outside a run): print as Ray would
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
