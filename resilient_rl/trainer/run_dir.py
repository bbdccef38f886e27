"""The run folder: resolved config, metric history (JSONL) and events.

Metric lines are JSON with Python's shortest round-trip float repr, so a history read back
compares bit for bit with the values that were written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from resilient_rl.trainer.config import save_config


class RunDir:
    """``{output_dir}/{run_name}/`` with ``config.yaml``, ``metrics.jsonl`` and ``events.jsonl``."""

    def __init__(self, output_dir: str, run_name: str):
        self.path = Path(output_dir) / run_name
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.events_path = self.path / "events.jsonl"
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []

    def save_config(self, cfg) -> None:
        save_config(cfg, str(self.path / "config.yaml"))

    def truncate_metrics_after(self, step: int) -> None:
        """Drop history lines past ``step`` (a resumed run rewrites them identically)."""
        rows = [r for r in self.read_metrics() if r["step"] <= step]
        tmp = self.metrics_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.metrics_path)

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        with open(self.metrics_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event (failure, recovery, checkpoint, ...) with a wall-clock timestamp.

        Then passes ``(kind, fields)`` to every subscriber (the experiment trackers).
        """
        with open(self.events_path, "a") as f:
            f.write(json.dumps({"time": time.time(), "event": kind, **fields}) + "\n")
        for listener in list(self._listeners):
            listener(kind, dict(fields))

    def subscribe(self, listener: Callable[[str, dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``listener(kind, fields)`` on every later event; returns a function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None


def deterministic_view(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """History without wall-clock fields (``timing/*``, ``perf/*``): what must match bit for bit."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]
