"""Finding and inspecting a run's checkpoints from the command line (``checkpoints list``, ``status``).

A checkpoint is named on the command line in one of three ways (see :func:`locate`):

- a run name, under a checkpoint root (``ppo-copy`` with ``--root checkpoints``);
- a run folder URL (``checkpoints/ppo-copy``, ``s3://bucket/ckpt/ppo-copy``);
- a step folder URL (``checkpoints/ppo-copy/step_00000020``).

:func:`inspect_run` lists a run's step folders with their commit state, size, age and checksum
state (sizes only, or every file's sha256 with ``deep``). It reads what it prints: the run's top
level, each step folder's listing and manifest (side by side: on an object store each is a round
trip), the ``latest`` pointer and the lease; never the shards (but to hash them with ``deep``)
nor the timelines set aside in ``abandoned/``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from resilient_rl.checkpoint.discovery import timeline_of
from resilient_rl.checkpoint.fanout import map_ordered
from resilient_rl.checkpoint.leases.run_lease import Lease, read_lease
from resilient_rl.checkpoint.manager import ABANDONED_DIR, CheckpointManager
from resilient_rl.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME, Manifest, parse_step_dirname
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.errors import (
    CheckpointCorruptError, CheckpointError, CheckpointFormatError, CheckpointNotFoundError, ConfigError,
)

__all__ = ["DEFAULT_ROOT", "CheckpointInfo", "CheckpointLocation", "CheckpointRow", "RunReport", "describe_status",
           "inspect_run", "list_checkpoints", "locate", "require_committed", "verify_problem"]

log = logging.getLogger(__name__)

DEFAULT_ROOT = "checkpoints"   # CheckpointConfig.root's default


@dataclass(frozen=True)
class CheckpointInfo:
    """One step folder: committed or not, total size, age (committed only) and shallow status."""

    step: int
    committed: bool
    size_bytes: int
    age_s: float | None
    status: str


@dataclass(frozen=True)
class _StepFolder:
    """What ``checkpoints list`` reads of one step folder: its files' sizes and its manifest."""

    step: int
    files: dict[str, int]
    manifest: Manifest | None = None
    problem: CheckpointError | None = None  # the manifest cannot be loaded (corrupt, newer format)


def _read_step_folder(manager: CheckpointManager, step: int) -> _StepFolder:
    files = manager.storage.find(manager.step_rel(step))
    if MANIFEST_NAME not in files:
        return _StepFolder(step, files)
    try:
        return _StepFolder(step, files, manager.load_manifest(step))
    except (CheckpointCorruptError, CheckpointFormatError) as exc:
        return _StepFolder(step, files, problem=exc)


def _step_folders(manager: CheckpointManager, names: list[str] | None = None) -> list[_StepFolder]:
    """Every step folder of the run, oldest first: one listing of the run's top level (``names``,
    when the caller made it), then each step folder's listing and manifest, side by side. Not a
    walk of the whole run: ``abandoned/`` can hold many times its files, and no file is opened
    but the manifests."""
    names = manager.storage.ls(manager.run_name) if names is None else names
    steps = sorted({s for s in map(parse_step_dirname, names) if s is not None})
    return map_ordered(lambda step: _read_step_folder(manager, step), steps)


def _info(manager: CheckpointManager, folder: _StepFolder, now: float) -> CheckpointInfo:
    size = sum(folder.files.values())
    if MANIFEST_NAME not in folder.files:
        return CheckpointInfo(folder.step, False, size, None, "uncommitted")
    if isinstance(folder.problem, CheckpointFormatError):  # listed, not loaded: a newer version wrote it
        return CheckpointInfo(folder.step, True, size, None, f"newer format: {folder.problem}")
    if folder.manifest is None:
        return CheckpointInfo(folder.step, True, size, None, f"corrupt: {MANIFEST_NAME}: {folder.problem}")
    status = manager.verifier.check(manager.step_rel(folder.step), folder.manifest, folder.files, deep=False)
    return CheckpointInfo(folder.step, True, size, max(0.0, now - folder.manifest.created_at), status)


def list_checkpoints(manager: CheckpointManager) -> list[CheckpointInfo]:
    """Every step folder of ``manager``'s run, oldest first, with a shallow (sizes only) status."""
    now = time.time()
    return [_info(manager, folder, now) for folder in _step_folders(manager)]


# --------------------------------------------------------------------------------- locations
@dataclass(frozen=True)
class CheckpointLocation:
    """A run (``root`` + ``run``) and, when one was named, a step of it."""

    root: str
    run: str
    step: int | None = None


def locate(target: str, root: str | None = None, step: int | None = None) -> CheckpointLocation:
    """Resolve a run name, run folder URL or step folder URL (see the module docstring).

    ``root`` only goes with a bare run name; ``step`` must agree with a step folder URL."""
    if not target or not target.strip():
        raise ConfigError("a run name or checkpoint folder URL is required")
    target = target.strip()
    if step is not None and step < 0:
        raise ConfigError(f"--step must be >= 0, got {step}")
    if "/" not in target:
        return CheckpointLocation(root or DEFAULT_ROOT, target, step)
    if root is not None:
        raise ConfigError(f"--root {root!r} goes with a run name; {target!r} is already a folder URL")
    parent, _, name = target.rstrip("/").rpartition("/")
    named = parse_step_dirname(name)
    if named is not None:
        if step is not None and step != named:
            raise ConfigError(f"--step {step} contradicts the step folder {target!r}")
        parent, _, name = parent.rpartition("/")
        step = named
    if not name or not parent or parent.endswith(":/"):
        raise ConfigError(f"{target!r}: expected a run folder such as checkpoints/my-run "
                          "or a step folder such as checkpoints/my-run/step_00000020")
    return CheckpointLocation(parent, name, step)


def open_manager(loc: CheckpointLocation, storage_options: dict[str, Any] | None) -> CheckpointManager:
    """The checkpoint manager of the run ``loc`` names."""
    return CheckpointManager(loc.root, loc.run, storage_options=storage_options)


def _pointer(manager: CheckpointManager) -> int | None:
    data = manager.storage.try_read_bytes(Storage.join(manager.run_name, LATEST_NAME))
    return None if data is None else parse_step_dirname(data.decode(errors="replace").strip())


def describe_status(manager: CheckpointManager, step: int, status: str) -> str:
    """A status from :meth:`CheckpointManager.verify` with the corrupt file's full URL."""
    if not status.startswith("corrupt:"):
        return f"{manager.step_dir(step)}: {status}"
    _, path, why = (status.split(": ", 2) + ["", ""])[:3]
    return f"{manager.step_dir(step)}/{path}: {why}"


def require_committed(root: str, run: str, storage_options: dict[str, Any] | None = None) -> int:
    """The newest committed step of ``run`` whose files have the manifest's sizes; raises
    CheckpointNotFoundError naming the run and root when there is none (a run to resume)."""
    manager = CheckpointManager(root, run, storage_options=storage_options)
    committed = manager.timeline_steps()
    if not committed:
        raise CheckpointNotFoundError(
            f"cannot resume run {run!r}: it has no committed checkpoint under checkpoint.root={root!r} "
            f"({manager.run_url}); start it with `resilient-rl train`")
    for step in reversed(committed):
        if manager.verify(step, deep=False) == "ok":
            return step
    raise CheckpointCorruptError(
        f"cannot resume run {run!r}: every committed checkpoint under checkpoint.root={root!r} is damaged "
        f"(newest: {describe_status(manager, committed[-1], manager.verify(committed[-1], deep=False))})")


# --------------------------------------------------------------------------------- list / verify
@dataclass(frozen=True)
class CheckpointRow:
    """One step folder as shown by ``checkpoints list|verify``."""

    step: int
    committed: bool
    size_bytes: int
    age_s: float | None
    status: str
    latest: bool


@dataclass
class RunReport:
    """A run's step folders and the checksum depth they were checked with."""

    manager: CheckpointManager
    rows: list[CheckpointRow]
    deep: bool
    pointer: int | None
    step: int | None = None  # the one step asked for, if any
    lease: Lease | None = None  # who writes (or last wrote) the run
    resumed: int | None = None  # the step a resume would start from (the timeline's newest)
    set_aside: int = 0  # timelines moved to {run}/abandoned/

    @property
    def run_url(self) -> str:
        return self.manager.run_url

    def newest_committed(self) -> CheckpointRow | None:
        committed = [r for r in self.rows if r.committed]
        return committed[-1] if committed else None

    def format_table(self) -> str:
        """A fixed-width table, one line per step folder, oldest first."""
        header = ("STEP", "COMMITTED", "SIZE", "AGE", "CHECK", "LATEST")
        lines = [tuple(str(x) for x in (r.step, "yes" if r.committed else "no", _size(r.size_bytes),
                                        _age(r.age_s), self._check(r), "latest" if r.latest else ""))
                 for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        out = [f"run: {self.run_url}"]
        for row in [header, *lines]:
            out.append("  ".join(c.rjust(w) if i == 0 else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if not self.rows:
            out.append("(no step folders)")
        newest = self.newest_committed()
        if self.step is None and newest is not None and self.pointer != newest.step:
            why = ("it is the one resumed from" if self.resumed in (None, newest.step) else
                   f"committed before step {self.pointer}: not on the run's timeline; a resume loads step {self.resumed}")
            out.append(f"note: `{LATEST_NAME}` names {self.pointer if self.pointer is not None else 'nothing'}; "
                       f"the newest committed step is {newest.step} ({why})")
        if self.lease is not None:
            state = "released by" if self.lease.released else "held by"
            out.append(f"lease: {state} {self.lease.describe()}")
        if self.set_aside:
            out.append(f"set aside: {self.set_aside} abandoned timeline(s) under {self.run_url}/{ABANDONED_DIR}/")
        return "\n".join(out)

    def _check(self, row: CheckpointRow) -> str:
        if row.status == "ok":
            return "sha256 ok" if self.deep else "sizes ok"
        return row.status.replace("corrupt:", "CORRUPT:", 1)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit} {(s % size) // sub_size:02d}{sub}"
    return f"{s}s"


def inspect_run(loc: CheckpointLocation, deep: bool, storage_options: dict[str, Any] | None = None) -> RunReport:
    """Every step folder of the run (only ``loc.step`` when given), checked by size, or by
    size and sha256 of every file with ``deep``. Raises CheckpointNotFoundError when the run
    folder or the asked step does not exist."""
    manager = open_manager(loc, storage_options)
    if not manager.storage.exists(loc.run):
        raise CheckpointNotFoundError(f"no checkpoints of run {loc.run!r} under root {loc.root!r} "
                                      f"({manager.run_url} does not exist)")
    pointer = _pointer(manager)
    now = time.time()
    rows = []
    folders = _step_folders(manager)
    for folder in folders:
        info = _info(manager, folder, now)
        if loc.step is not None and info.step != loc.step:
            continue
        status = info.status
        if deep and info.committed and status == "ok" and folder.manifest is not None:
            status = manager.verifier.check(manager.step_rel(info.step), folder.manifest, folder.files, deep=True)
        rows.append(CheckpointRow(info.step, info.committed, info.size_bytes, info.age_s, status,
                                  info.step == pointer))
    if loc.step is not None and not rows:
        raise CheckpointNotFoundError(f"run {loc.run!r} has no step {loc.step} ({manager.step_dir(loc.step)} "
                                      "does not exist)")
    lease = read_lease(manager.storage, loc.run)
    set_aside = len(manager.storage.ls(Storage.join(loc.run, ABANDONED_DIR)))
    return RunReport(manager, rows, deep, pointer, loc.step, lease, _resumed(folders, pointer), set_aside)


def _resumed(folders: list[_StepFolder], pointer: int | None) -> int | None:
    """The step a resume starts from (:meth:`CheckpointManager.latest_step`), from what the
    listing read: the committed steps and their manifests."""
    manifests = {f.step: f.manifest for f in folders if MANIFEST_NAME in f.files}

    def order(step: int) -> tuple[int, float] | None:
        m = manifests.get(step)
        return None if m is None else (m.fencing_token or 0, m.created_at)
    timeline = timeline_of(sorted(manifests), pointer, order)
    return timeline[-1] if timeline else None


def verify_problem(report: RunReport) -> str | None:
    """Why ``checkpoints verify`` fails: the asked step (or else the newest committed one) is
    uncommitted or corrupt, or nothing is committed. None when it passes."""
    manager = report.manager
    if report.step is not None:
        row = report.rows[0]
        if not row.committed:
            return f"{manager.step_dir(row.step)} is not committed (no {MANIFEST_NAME})"
        return None if row.status == "ok" else f"corrupt checkpoint: {describe_status(manager, row.step, row.status)}"
    newest = report.newest_committed()
    if newest is None:
        return f"run {manager.run_name!r} has no committed checkpoint under {report.run_url}"
    if newest.status == "ok":
        return None
    valid = [r.step for r in report.rows if r.committed and r.status == "ok"]
    fallback = f"; resuming falls back to step {valid[-1]}" if valid else "; no valid checkpoint is left"
    return f"latest checkpoint is corrupt: {describe_status(manager, newest.step, newest.status)}{fallback}"
