"""The run folder: resolved config, metric history (JSONL) and events.

Events are typed (:mod:`resilient_rl.events`): :meth:`RunDir.event` builds one, refusing fields
its kind does not have, appends its line and publishes it on ``run_dir.bus``.

Metric lines are JSON with Python's shortest round-trip float repr, so a history read back
compares bit for bit with the values that were written.

A process can be killed in the middle of an append, leaving a *torn* last line. Every line is
therefore written with one ``write`` call on a file opened for appending, and a line only
counts once its newline is on disk: readers skip an unterminated last line with a warning, and
the first append of a process cuts it off before writing, so a torn row never glues onto the
next one (the readers are in :mod:`resilient_rl.jsonl`). A restore drops the rows after the restored step by truncating the file at the first
such row (found by one forward scan), never by rewriting the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from resilient_rl.config.schema import save_config
from resilient_rl.config.secrets import redact
from resilient_rl.errors import ConfigError, StorageError
from resilient_rl.events import AnyEvent, EventBus, event_to_json, make_event, read_events
from resilient_rl.jsonl import iter_lines_backward, last_rows, parse_line, read_jsonl, warn_torn

__all__ = ["RunDir", "deterministic_view", "read_jsonl"]

logger = logging.getLogger(__name__)

# Rows are written with "step" first, so its value is found without parsing the whole line.
_STEP_RE = re.compile(rb'^\{"step": (\d+)[,}]')
_TAIL_PROBE = 64 * 1024


def _cut_torn_tail(path: Path) -> None:
    """Truncate an unterminated last line, so the next append starts on a fresh line."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        end = size
        while end > 0:  # find the last newline, reading backwards
            start = max(0, end - _TAIL_PROBE)
            f.seek(start)
            block = f.read(end - start)
            i = block.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
        else:
            keep = 0
        logger.warning("%s: cutting a torn last line (%d bytes at byte %d) left by a killed writer",
                       path, size - keep, keep)
        f.truncate(keep)


#: OS errors that a setting can fix (a folder the user may not write, a name too long, a path that
#: cannot exist: a parent that cannot be created, a symlink loop): exit 2, not 4.
_SETTING_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EEXIST,
                   errno.ENOENT, errno.ELOOP)


def output_dir_error(output_dir: str, what: str, exc: OSError) -> Exception:
    """``exc`` (met while ``what``, under ``trainer.output_dir``) as the project's error naming the
    setting, the path and the reason: a ConfigError when a setting fixes it, else a StorageError."""
    message = f"trainer.output_dir={output_dir!r}: {what}: {exc}"
    return ConfigError(message) if exc.errno in _SETTING_ERRNOS else StorageError(message)


class RunDir:
    """``{output_dir}/{run_name}/`` with ``config.yaml``, ``metrics.jsonl`` and ``events.jsonl``."""

    def __init__(self, output_dir: str, run_name: str):
        self.output_dir = output_dir
        self.path = Path(output_dir) / run_name
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_dir_error(output_dir, f"cannot create the run folder {self.path}", exc) from exc
        self.metrics_path = self.path / "metrics.jsonl"
        self.events_path = self.path / "events.jsonl"
        self.bus = EventBus()  # every event written, as a typed event, to its subscribers (trackers)
        self._repaired: set[Path] = set()

    @property
    def key(self) -> str:
        """A short key of this run's folder (the same for every controller of the run)."""
        return hashlib.sha1(str(self.path.resolve()).encode()).hexdigest()[:12]

    def save_config(self, cfg) -> None:
        """Write the resolved config (credentials in storage options redacted)."""
        try:
            save_config(cfg, str(self.path / "config.yaml"))
        except OSError as exc:
            raise output_dir_error(self.output_dir, f"cannot write {self.path / 'config.yaml'}", exc) from exc

    def _append(self, path: Path, obj: dict[str, Any]) -> None:
        """Append ``obj`` as one complete line with a single ``write`` on an O_APPEND descriptor
        (line-atomic against other appenders and, up to a crash mid-call, against readers)."""
        if path not in self._repaired:
            _cut_torn_tail(path)
            self._repaired.add(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview((json.dumps(obj) + "\n").encode())
            while view:  # a short write happens only on a full disk or a signal; finish the line
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def truncate_metrics_after(self, step: int) -> int:
        """Drop history lines past ``step`` (a resumed run rewrites them identically), and a torn
        last line; returns the number of rows dropped. Rows are in step order: the file is read
        from its end down to the last row it keeps and cut there, so a rollback reads the rows it
        drops, not a long run's whole history, and the rows before the cut are never rewritten."""
        path = self.metrics_path
        if not path.exists():
            return 0
        cut, dropped = None, 0
        for offset, raw in iter_lines_backward(path):
            if not raw.endswith(b"\n"):
                warn_torn(path, offset, raw)
                cut = offset
                continue
            if not raw.strip():
                continue
            match = _STEP_RE.match(raw)
            row_step = int(match.group(1)) if match else parse_line(path, f"at byte {offset}", raw).get("step")
            if isinstance(row_step, int) and row_step <= step:
                break
            cut, dropped = offset, dropped + 1
        if cut is not None:
            os.truncate(path, cut)
        self._repaired.add(path)
        return dropped

    def set_aside_history(self) -> Path | None:
        """A run starting from step 0 in a folder that holds an earlier history: move that
        ``metrics.jsonl`` to ``abandoned/metrics-<UTC time>.jsonl`` (kept, not deleted), so this
        run's rows are not appended after it and a later rollback cannot cut the earlier rows
        (they hold the same step numbers). Returns where it went; None when there was none."""
        if not self.metrics_path.exists() or self.metrics_path.stat().st_size == 0:
            return None
        dest_dir = self.path / "abandoned"
        dest_dir.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = dest_dir / f"metrics-{stamp}.jsonl"
        n = 1
        while dest.exists():
            n += 1
            dest = dest_dir / f"metrics-{stamp}-{n}.jsonl"
        os.replace(self.metrics_path, dest)
        self._repaired.discard(self.metrics_path)
        logger.warning("%s held the history of an earlier run of this folder; it was moved to %s and this run "
                       "starts a new one from step 0", self.metrics_path, dest)
        return dest

    def append_metrics(self, row: dict[str, Any]) -> None:
        self._append(self.metrics_path, row)

    def read_metrics(self, last: int | None = None) -> list[dict[str, Any]]:
        """Every complete row (or only the ``last`` ones, read from the file's end)."""
        return last_rows(self.metrics_path, last) if last is not None else list(read_jsonl(self.metrics_path))

    def read_column(self, key: str) -> list[float]:
        """The values of ``key`` over the history (rows without it are skipped), as floats."""
        return [float(row[key]) for row in read_jsonl(self.metrics_path) if key in row]

    def read_events(self) -> list[dict[str, Any]]:
        """Every event recorded so far, as validated dicts (:func:`resilient_rl.events.read_events`)."""
        return read_events(self.events_path)

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event (failure, recovery, checkpoint, ...) with a wall-clock timestamp, then
        publish it on :attr:`bus`.

        Raises:
            EventSchemaError: ``kind`` is unknown or ``fields`` are not its fields
            (:func:`resilient_rl.events.make_event`); nothing is written then."""
        ev = make_event(kind, **redact(fields, keys=False))  # e.g. a URL with credentials in a reason
        self._append(self.events_path, event_to_json(ev))
        self.bus.publish(ev)

    def subscribe(self, listener: Callable[[AnyEvent], None], *kinds: type) -> Callable[[], None]:
        """Call ``listener(event)`` with every later event (of the event types ``kinds`` only, where
        given), typed (one dataclass per kind, :mod:`resilient_rl.events.kinds`); returns a function
        that unsubscribes. A listener that raises is logged and skipped (:class:`~resilient_rl.events.EventBus`)."""
        return self.bus.subscribe(listener, *kinds)


def deterministic_view(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """History without wall-clock and per-process fields (``timing/*``, ``perf/*``: times, and
    counts such as compiles that a restarted process pays again): what must match bit for bit."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]
