"""Reading the JSON-lines files of a run folder (``metrics.jsonl``, ``events.jsonl``).

A writer appends each line with one ``write`` call (see :mod:`resilient_rl.run.folder`),
so a line counts only once its newline is on disk: an unterminated last line was cut short by a
writer killed mid-append (or is being written right now) and is skipped with a warning. Any
other line that is not a JSON object is damage, reported with :class:`RunFolderError` naming
the file and the line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from resilient_rl.errors import RunFolderError

logger = logging.getLogger(__name__)


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(byte offset, raw line with its newline) of every line; the last may lack the newline."""
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            yield offset, raw
            offset += len(raw)


def iter_lines_backward(path: Path, block: int = 1 << 16) -> Iterator[tuple[int, bytes]]:
    """(byte offset, raw line with its newline) of every line, the last first, read in blocks from
    the end: what a long run's rollback needs (its last rows) costs what it reads, not the file's
    size. The last line may lack the newline (a torn append)."""
    with open(path, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        carry = b""  # the line read last, whose start may lie before ``pos``
        while True:
            read = min(block, pos)
            pos -= read
            f.seek(pos)
            buf = f.read(read) + carry
            pieces = buf.split(b"\n")
            lines = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
            offset = pos + len(buf)
            carry = lines.pop(0) if pos > 0 and lines else b""
            for line in reversed(lines):
                offset -= len(line)
                yield offset, line
            if pos == 0:
                return


def last_rows(path: str | Path, n: int) -> list[dict[str, Any]]:
    """The last ``n`` complete rows of ``path`` in file order, read from its end (a torn last line
    is skipped with a warning; a damaged line among them raises as in :func:`numbered_rows`)."""
    path = Path(path)
    if n <= 0 or not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    for offset, raw in iter_lines_backward(path):
        if not raw.endswith(b"\n"):
            warn_torn(path, offset, raw)
        elif raw.strip():
            rows.append(parse_line(path, f"at byte {offset}", raw))
            if len(rows) == n:
                break
    return rows[::-1]


def warn_torn(path: Path, offset: int, raw: bytes) -> None:
    logger.warning("%s: ignoring a torn last line at byte %d (%d bytes without a newline: a writer was "
                   "killed mid-append)", path, offset, len(raw))


def parse_line(path: Path, lineno: int | str, raw: bytes) -> dict[str, Any]:
    """The JSON object on line ``lineno`` (a number, or where the line starts), or RunFolderError
    naming file and line."""
    where = f"line {lineno}" if isinstance(lineno, int) else f"the line {lineno}"
    try:
        row = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise RunFolderError(f"{path}: {where} is not valid JSON ({exc}); only a torn last line "
                             "is tolerated") from None
    if not isinstance(row, dict):
        raise RunFolderError(f"{path}: {where} is not a JSON object")
    return row


def numbered_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of every complete row of ``path`` (none when the file is absent).

    An unterminated last line (a torn append) is skipped with a warning; blank lines are skipped;
    any other line that is not a JSON object raises :class:`RunFolderError` naming file and line."""
    path = Path(path)
    if not path.exists():
        return
    for lineno, (offset, raw) in enumerate(iter_lines(path), start=1):
        if not raw.endswith(b"\n"):
            warn_torn(path, offset, raw)
            return
        if raw.strip():
            yield lineno, parse_line(path, lineno, raw)


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The complete rows of ``path``, as :func:`numbered_rows` finds them."""
    for _, row in numbered_rows(path):
        yield row
