"""The run folder: resolved config, metric history (JSONL) and events.

Metric lines are JSON with Python's shortest round-trip float repr, so a history read back
compares bit for bit with the values that were written.

A process can be killed in the middle of an append, leaving a *torn* last line. Every line is
therefore written with one ``write`` call on a file opened for appending, and a line only
counts once its newline is on disk: readers skip an unterminated last line with a warning, and
the first append of a process cuts it off before writing, so a torn row never glues onto the
next one. A restore drops the rows after the restored step by truncating the file at the first
such row (found by one forward scan), never by rewriting the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Iterable

from resilient_rl.errors import RunFolderError
from resilient_rl.config.schema import save_config

logger = logging.getLogger(__name__)

# Rows are written with "step" first, so its value is found without parsing the whole line.
_STEP_RE = re.compile(rb'^\{"step": (\d+)[,}]')
_TAIL_PROBE = 64 * 1024


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(byte offset, raw line with its newline) of every line; the last may lack the newline."""
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            yield offset, raw
            offset += len(raw)


def _torn(path: Path, offset: int, raw: bytes) -> None:
    logger.warning("%s: ignoring a torn last line at byte %d (%d bytes without a newline: a writer was "
                   "killed mid-append)", path, offset, len(raw))


def _parse(path: Path, lineno: int, raw: bytes) -> dict[str, Any]:
    try:
        row = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise RunFolderError(f"{path}: line {lineno} is not valid JSON ({exc}); only a torn last line "
                             "is tolerated") from None
    if not isinstance(row, dict):
        raise RunFolderError(f"{path}: line {lineno} is not a JSON object")
    return row


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The complete rows of a JSONL file written by :class:`RunDir` (none when it is absent).

    An unterminated last line (a torn append) is skipped with a warning; any other line that
    is not a JSON object raises :class:`RunFolderError` naming the file and line."""
    path = Path(path)
    if not path.exists():
        return
    for lineno, (offset, raw) in enumerate(_lines(path), start=1):
        if not raw.endswith(b"\n"):
            _torn(path, offset, raw)
            return
        if raw.strip():
            yield _parse(path, lineno, raw)


def _append_line(path: Path, line: bytes) -> None:
    """Append one complete line with a single ``write`` on an O_APPEND descriptor (line-atomic
    against other appenders and, up to a crash mid-call, against readers)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:  # a short write happens only on a full disk or a signal; finish the line
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


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


class RunDir:
    """``{output_dir}/{run_name}/`` with ``config.yaml``, ``metrics.jsonl`` and ``events.jsonl``."""

    def __init__(self, output_dir: str, run_name: str):
        self.path = Path(output_dir) / run_name
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.events_path = self.path / "events.jsonl"
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._repaired: set[Path] = set()

    def save_config(self, cfg) -> None:
        """Write the resolved config (credentials in storage options redacted)."""
        save_config(cfg, str(self.path / "config.yaml"))

    def _append(self, path: Path, obj: dict[str, Any]) -> None:
        if path not in self._repaired:
            _cut_torn_tail(path)
            self._repaired.add(path)
        _append_line(path, (json.dumps(obj) + "\n").encode())

    def truncate_metrics_after(self, step: int) -> int:
        """Drop history lines past ``step`` (a resumed run rewrites them identically), and a torn
        last line; returns the number of rows kept. The file is cut at the first dropped line
        (rows are in step order), so the rows before it are never rewritten."""
        path = self.metrics_path
        if not path.exists():
            return 0
        cut, kept = None, 0
        for lineno, (offset, raw) in enumerate(_lines(path), start=1):
            if not raw.endswith(b"\n"):
                _torn(path, offset, raw)
                cut = offset
                break
            if not raw.strip():
                continue
            match = _STEP_RE.match(raw)
            row_step = int(match.group(1)) if match else _parse(path, lineno, raw).get("step")
            if not isinstance(row_step, int) or row_step > step:
                cut = offset
                break
            kept += 1
        if cut is not None:
            os.truncate(path, cut)
        self._repaired.add(path)
        return kept

    def append_metrics(self, row: dict[str, Any]) -> None:
        self._append(self.metrics_path, row)

    def read_metrics(self, last: int | None = None) -> list[dict[str, Any]]:
        """Every complete row (or only the ``last`` ones, read without holding the others)."""
        rows = read_jsonl(self.metrics_path)
        return list(deque(rows, maxlen=last)) if last is not None else list(rows)

    def read_column(self, key: str) -> list[float]:
        """The values of ``key`` over the history (rows without it are skipped), as floats."""
        return [float(row[key]) for row in read_jsonl(self.metrics_path) if key in row]

    def read_events(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events_path))

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event (failure, recovery, checkpoint, ...) with a wall-clock timestamp.

        Then passes ``(kind, fields)`` to every subscriber (the experiment trackers).
        """
        self._append(self.events_path, {"time": time.time(), "event": kind, **fields})
        for listener in list(self._listeners):
            listener(kind, dict(fields))

    def subscribe(self, listener: Callable[[str, dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``listener(kind, fields)`` on every later event; returns a function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None


def deterministic_view(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """History without wall-clock fields (``timing/*``, ``perf/*``): what must match bit for bit."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]
