"""Prometheus file-based service discovery: the targets file a run keeps current.

Prometheus watches the files matched by ``file_sd_configs`` (``monitoring/prometheus.yml`` reads
``targets/*.json``) and scrapes the endpoints listed there. A run registers its exporters (the
controller's and one per node) with :class:`FileSDWriter`; every change rewrites the file
atomically (temporary file + ``os.replace``), so Prometheus never reads half a file. The
temporary file's name does not end in ``.json`` and is never matched by the glob.

File format (one group per distinct label set)::

    [{"targets": ["10.0.0.5:9400"], "labels": {"job": "resilient-rl", "run": "r1", "node": "n0"}}]
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Mapping

from resilient_rl.errors import TelemetryError

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_TARGET = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def _check_target(target: str) -> str:
    match = _TARGET.match(target)
    if match is None or not 0 < int(match.group(2)) <= 65535:
        raise TelemetryError(f"file_sd target {target!r} is not host:port")
    return target


def _check_labels(target: str, labels: Mapping[str, str]) -> dict[str, str]:
    checked = {}
    for name, value in labels.items():
        # Names starting with __ are Prometheus-internal and dropped after relabelling.
        if not isinstance(name, str) or not _LABEL_NAME.match(name) or name.startswith("__"):
            raise TelemetryError(f"file_sd target {target}: invalid label name {name!r}")
        if not isinstance(value, str):
            raise TelemetryError(f"file_sd target {target}: label {name!r} must be a string, "
                                 f"got {type(value).__name__}")
        checked[name] = value
    return checked


class FileSDWriter:
    """Keeps a Prometheus ``file_sd`` JSON targets file in line with the live endpoints.

    Args:
        path: the targets file, e.g. ``monitoring/targets/<run>.json``; parent directories are
            created. Use one file per run so that runs do not overwrite each other's targets.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.suffix != ".json":
            raise TelemetryError(f"file_sd path {self.path} must end in .json "
                                 "(Prometheus matches targets/*.json)")
        self._lock = threading.Lock()
        self._targets: dict[str, dict[str, str]] = {}

    @property
    def targets(self) -> dict[str, dict[str, str]]:
        """The registered targets and their labels."""
        with self._lock:
            return {t: dict(labels) for t, labels in self._targets.items()}

    def update(self, targets: Iterable[tuple[str, Mapping[str, str]]]) -> None:
        """Replace every target with ``targets`` [(host:port, labels)] and rewrite the file."""
        new = {}
        for target, labels in targets:
            new[_check_target(target)] = _check_labels(target, labels)
        with self._lock:
            self._targets = new
            self._write()

    def add(self, target: str, labels: Mapping[str, str]) -> None:
        """Register (or relabel) one target and rewrite the file."""
        checked = _check_labels(_check_target(target), labels)
        with self._lock:
            self._targets[target] = checked
            self._write()

    def remove(self, target: str) -> None:
        """Unregister one target (unknown targets are ignored) and rewrite the file."""
        with self._lock:
            if self._targets.pop(target, None) is not None:
                self._write()

    def close(self, remove_file: bool = True) -> None:
        """Forget every target; by default delete the file so Prometheus stops scraping."""
        with self._lock:
            self._targets = {}
            if remove_file:
                self.path.unlink(missing_ok=True)
            else:
                self._write()

    def _groups(self) -> list[dict[str, object]]:
        groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for target, labels in sorted(self._targets.items()):
            groups.setdefault(tuple(sorted(labels.items())), []).append(target)
        return [{"targets": targets, "labels": dict(labels)} for labels, targets in groups.items()]

    def _write(self) -> None:
        data = json.dumps(self._groups(), indent=2, sort_keys=True) + "\n"
        try:  # the folder is the user's (telemetry.file_sd_path): one it cannot create is named too
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        except OSError as exc:
            raise TelemetryError(f"cannot write file_sd targets {self.path}: {exc}") from exc
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # mkstemp creates 0600; Prometheus may run as another user (e.g. in a container).
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise TelemetryError(f"cannot write file_sd targets {self.path}: {exc}") from exc
