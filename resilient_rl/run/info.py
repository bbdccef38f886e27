"""Read what a run left in its folder, without starting anything: for ``status``, ``plot`` and the
reward line at the end of ``train``.

A run folder is ``{trainer.output_dir}/{run_name}/`` (:class:`~resilient_rl.run.folder.RunDir`):
``config.yaml``, ``metrics.jsonl`` (one row per kept step), ``events.jsonl`` (failures, recoveries,
checkpoints), ``controller.json`` (:mod:`resilient_rl.run.record`) and, while the
run serves metrics, ``prometheus_targets.json``. :func:`open_run` reads all of it;
:func:`failure_episodes` pairs each failure with the recovery (or abort) that followed it.

The run may be writing while it is read: a last line cut short by a concurrent append is skipped
(:mod:`resilient_rl.jsonl`). Events are read by :func:`resilient_rl.events.read_events`: validated
dicts with every field of their kind, lines of kinds this code does not know kept as written.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from resilient_rl.errors import RunFolderError
from resilient_rl.events import read_events
from resilient_rl.jsonl import read_jsonl
from resilient_rl.run.record import ControllerRecord, read_controller_record

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "runs"   # TrainerConfig.output_dir's default
RUN_FILES = ("config.yaml", "metrics.jsonl", "events.jsonl")
TARGETS_NAME = "prometheus_targets.json"


def _get(tree: dict, dotted: str, default: Any = None) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


@dataclass
class RunFiles:
    """Everything a run folder holds, as read at ``read_at``."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]          # resilient_rl.events.read_events
    controller: ControllerRecord | None
    targets: list[dict[str, Any]] | None   # file_sd groups, None when the file is absent
    targets_path: Path
    metrics_mtime: float | None
    read_at: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        return str(_get(self.config, "trainer.run_name") or self.path.name)

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A value of the run's saved config by dotted key (``checkpoint.root``), or ``default``."""
        return _get(self.config, dotted, default)

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] in kinds]


def resolve_run_path(target: str, output_dir: str | None = None) -> Path:
    """A run name (under ``output_dir``, default ``runs``) or a run folder path -> the folder.

    Raises:
        RunFolderError: the folder does not exist or holds none of a run's files (names the path).
    """
    if not target or not target.strip():
        raise RunFolderError("a run name or run folder path is required")
    target = target.strip()
    given = Path(target)
    if output_dir is None and ("/" in target or given.is_dir()):
        path = given
    else:
        path = Path(output_dir or DEFAULT_OUTPUT_DIR) / target
    if not path.exists():
        raise RunFolderError(f"no run folder at {path}" + ("" if "/" in target else
                             f" (run {target!r} under --output-dir {output_dir or DEFAULT_OUTPUT_DIR})"))
    if not path.is_dir():
        raise RunFolderError(f"{path} is not a folder; expected a run folder such as runs/ppo-copy")
    if not any((path / name).exists() for name in RUN_FILES):
        raise RunFolderError(f"{path} is not a run folder: it has none of {', '.join(RUN_FILES)}")
    return path


def open_run(target: str, output_dir: str | None = None) -> RunFiles:
    """Read the run folder named by ``target`` (see :func:`resolve_run_path`)."""
    path = resolve_run_path(target, output_dir)
    config: dict[str, Any] = {}
    config_path = path / "config.yaml"
    if config_path.exists():
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise RunFolderError(f"{config_path}: not YAML ({exc})") from exc
        if not isinstance(config, dict):
            raise RunFolderError(f"{config_path}: expected a mapping, got {type(config).__name__}")
    targets_path = Path(_get(config, "telemetry.file_sd_path") or path / TARGETS_NAME)
    targets = None
    try:
        targets = json.loads(targets_path.read_text())
    except FileNotFoundError:
        pass
    except (json.JSONDecodeError, OSError) as exc:
        logger.warning("cannot read %s: %s", targets_path, exc)
    metrics_path = path / "metrics.jsonl"
    return RunFiles(path=path, config=config, metrics=list(read_jsonl(metrics_path)),
                    events=read_events(path / "events.jsonl"), controller=read_controller_record(path),
                    targets=targets if isinstance(targets, list) else None, targets_path=targets_path,
                    metrics_mtime=metrics_path.stat().st_mtime if metrics_path.exists() else None)


@dataclass
class FailureEpisode:
    """One failure and what followed: a recovery (restored step, replayed steps, duration) or an abort."""

    step: int
    cause: str
    role: str | None
    rank: int | None
    message: str
    time: float
    outcome: str = "pending"            # recovered | aborted | pending (recovery in progress or cut short)
    restored_step: int | None = None
    steps_replayed: int = 0
    recovery_s: float | None = None
    restarted: list[str] = field(default_factory=list)   # "group rank N" of each restarted worker
    killed_unresponsive: list[str] = field(default_factory=list)
    failures_during_recovery: int = 0
    abort_reason: str | None = None
    state: str | None = None            # the last recovery state entered (recovering, rejoining, ...)

    @property
    def who(self) -> str:
        if self.role is None:
            return "unknown worker"
        return self.role if self.rank is None else f"{self.role} rank {self.rank}"


def short_group(text: Any, run: str | None) -> Any:
    """``rrl_{run}_{instance}_main:rollout`` -> ``main:rollout``: worker-group names (also inside a
    message) without the run and instance prefix that makes Ray actor names unique."""
    if not isinstance(text, str) or not run:
        return text
    return re.sub(rf"\brrl_{re.escape(run)}_[0-9a-f]+_", "", text)


def failure_episodes(events: list[dict[str, Any]], run: str | None = None) -> list[FailureEpisode]:
    """Each ``failure`` event with the recovery events up to its ``recovered`` or ``aborted``;
    worker-group names are shortened by :func:`short_group` for run ``run``."""
    episodes: list[FailureEpisode] = []
    current: FailureEpisode | None = None
    for e in events:
        kind = e.get("event")
        if kind == "failure":
            current = FailureEpisode(step=int(e.get("step", 0)), cause=str(e.get("cause", "?")),
                                     role=short_group(e.get("role"), run), rank=e.get("rank"),
                                     message=short_group(str(e.get("message") or ""), run),
                                     time=float(e.get("time", 0.0)))
            episodes.append(current)
        elif current is None:
            continue
        elif kind in ("kill_unresponsive", "kill_hung"):  # stopped, or inside a call without progress
            current.killed_unresponsive.append(f"{short_group(e.get('group'), run)} rank {e.get('rank')}")
        elif kind == "failure_during_recovery":
            current.failures_during_recovery += 1
        elif kind == "recovery_state":
            current.state = e.get("state")
        elif kind == "recovered":
            current.outcome = "recovered"
            current.restored_step = e.get("restored_step")
            current.steps_replayed = int(e.get("steps_replayed", 0))
            current.recovery_s = e.get("duration_s")
            current.restarted = [f"{short_group(group, run)} rank {rank}" for group, rank in e.get("restarted") or []]
            current = None
        elif kind == "aborted":
            current.outcome = "aborted"
            current.abort_reason = e.get("reason")
            current = None
    return episodes


def checkpoint_steps(events: list[dict[str, Any]]) -> list[int]:
    """Steps whose checkpoint was committed during the run, in order, each once."""
    seen: dict[int, None] = {}
    for e in events:
        if e.get("event") == "checkpoint_committed":
            seen.setdefault(int(e["step"]), None)
    return list(seen)


def goodput(run: RunFiles, until: float | None = None) -> tuple[float, float, float] | None:
    """(ratio, useful seconds, wall seconds) of the controller's latest ``fit``, or None if unknown.

    The same figure as the ``rrl_goodput_ratio`` gauge: the summed duration of the steps this
    ``fit`` ran and kept (steps past the one it started from; a rolled-back step's row is gone,
    its replay counts) over the wall time since ``fit`` began, up to its recorded end, else
    ``until`` (default: when the folder was read).
    """
    rec = run.controller
    if rec is None or rec.start_step is None:
        return None
    end = rec.ended_at if rec.ended_at is not None else (until if until is not None else run.read_at)
    useful = sum(float(r.get("timing/step_s", 0.0)) for r in run.metrics if int(r["step"]) > rec.start_step)
    wall = end - rec.started_at
    if wall <= 0:
        return None
    return min(1.0, useful / wall), useful, wall


def last_write_time(run: RunFiles) -> float | None:
    """The newest time the run wrote a metrics row or an event (None when it wrote neither)."""
    times = [float(e["time"]) for e in run.events if "time" in e]
    if run.metrics_mtime is not None:
        times.append(run.metrics_mtime)
    return max(times) if times else None


def reward_summary(rows: Sequence[dict] | Sequence[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last 10% of steps (at least one step each); ``rows``
    are metric rows or their ``reward/mean`` values (``RunDir.read_column("reward/mean")``)."""
    rewards = [r["reward/mean"] if isinstance(r, dict) else r for r in rows]
    k = max(1, len(rewards) // 10)
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
