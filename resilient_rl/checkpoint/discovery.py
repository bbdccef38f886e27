"""Finding a run's checkpoints: its step folders, the committed ones, the current timeline, reads.

:class:`CheckpointDiscovery` is the read side of :class:`~resilient_rl.checkpoint.manager.CheckpointManager`:
the folders of a run's steps, which of them are committed (hold a manifest), which belong to the
run's current timeline (``latest`` and the manifests' fencing tokens and commit times decide), the
newest step that verifies, and the manifest and trainer state of a step. It writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from resilient_rl.checkpoint.fanout import map_ordered
from resilient_rl.checkpoint.manifest import (
    LATEST_NAME, MANIFEST_NAME, TRAINER_STATE_NAME, FileRecord, Manifest, parse_step_dirname, step_dirname,
)
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.checkpoint.verify import Verifier
from resilient_rl.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError

log = logging.getLogger(__name__)


def check_name(kind: str, name: str) -> str:
    """``name`` when it is one path component (a run or role name); ConfigError otherwise."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"checkpoint {kind} must be a non-empty name without '/', got {name!r}")
    return name


def commit_order(manager: "CheckpointDiscovery", step: int) -> tuple[int, float] | None:
    """(fencing token, commit time) of a committed step; None when its manifest is unreadable."""
    try:
        m = manager.load_manifest(step)
    except CheckpointError:
        return None
    return (m.fencing_token or 0, m.created_at)


def timeline_of(committed: list[int], pointer: int | None,
                order: Callable[[int], tuple[int, float] | None]) -> list[int]:
    """The steps of ``committed`` (oldest first) on the timeline whose ``latest`` names ``pointer``;
    ``order(step)`` is a step's (fencing token, commit time), None when its manifest is unreadable.
    See :meth:`CheckpointDiscovery.timeline_steps`."""
    if pointer is None or pointer not in committed or committed[-1] == pointer:
        return committed
    base = order(pointer)
    if base is None:
        return committed
    keep = []
    for s in committed:
        step_order = order(s) if s > pointer else None
        if s <= pointer or step_order is None or step_order >= base:
            keep.append(s)  # an unreadable newer manifest is kept: verification reports it
        else:
            log.warning("ignoring committed step %d: it was committed before step %d, which `%s` names "
                        "(a superseded writer or an abandoned timeline)", s, pointer, LATEST_NAME)
    return keep


class CheckpointDiscovery:
    """Paths, discovery, loading and verification of one run's checkpoints (read only).

    The attributes below are set by :class:`~resilient_rl.checkpoint.manager.CheckpointManager`."""

    run_name: str
    storage: Storage
    verifier: Verifier
    on_corrupt: Callable[[int, str], None] | None

    # ----------------------------------------------------------------- paths
    @property
    def run_url(self) -> str:
        return self.storage.url_for(self.run_name)

    def same_run(self, other: "CheckpointDiscovery") -> bool:
        """Whether ``other`` manages this run's folder, however either spells its root."""
        return other.storage.location(other.run_name) == self.storage.location(self.run_name)

    def step_rel(self, step: int) -> str:
        """The folder of ``step``, relative to the storage root."""
        return Storage.join(self.run_name, step_dirname(step))

    def step_dir(self, step: int) -> str:
        """URL of the step folder (open it with this manager's storage options)."""
        return self.storage.url_for(self.step_rel(step))

    def role_dir(self, step: int, role: str) -> str:
        """URL of a role's folder in a step: where its workers write their shards."""
        return self.storage.url_for(Storage.join(self.step_rel(step), check_name("role", role)))

    # ----------------------------------------------------------------- discovery
    def step_folders(self, found: Mapping[str, int] | None = None) -> dict[int, dict[str, int]]:
        """{step: {path in the step folder: size}} for every step folder of the run, from a
        listing of every file of the run (``found``: that listing, when the caller made it)."""
        out: dict[int, dict[str, int]] = defaultdict(dict)
        for path, size in (self.storage.find(self.run_name) if found is None else found).items():
            head, _, rest = path.partition("/")
            step = parse_step_dirname(head)
            if step is not None and rest:
                out[step][rest] = size
        for name in self.storage.ls(self.run_name):
            step = parse_step_dirname(name)
            if step is not None:
                out.setdefault(step, {})
        return dict(out)

    def committed_steps(self, entries: Iterable[str] | None = None) -> list[int]:
        """The committed steps of the run, oldest first: the step folders holding a manifest.

        One listing of the run's top level (``entries``: its names, when the caller listed it
        already), then a query for each step folder's manifest: the shards of the steps and
        ``abandoned/`` are not listed (their files can outnumber the steps a thousandfold). The
        queries go out side by side: each is a round trip on an object store."""
        names = self.storage.ls(self.run_name) if entries is None else entries
        steps = sorted({s for s in map(parse_step_dirname, names) if s is not None})
        return [s for s, committed in zip(steps, map_ordered(self.is_committed, steps)) if committed]

    def is_committed(self, step: int) -> bool:
        return self.storage.exists(Storage.join(self.step_rel(step), MANIFEST_NAME))

    def _pointer(self) -> int | None:
        data = self.storage.try_read_bytes(Storage.join(self.run_name, LATEST_NAME))
        if data is None:
            return None
        return parse_step_dirname(data.decode(errors="replace").strip())

    def timeline_steps(self) -> list[int]:
        """The committed steps of the run's current timeline, oldest first: every committed step
        up to the one ``latest`` names, and a newer one only if it was committed after that one
        (the writer died between a manifest and the pointer), judged by fencing token, then
        commit time. Without a valid pointer, every committed step."""
        return timeline_of(self.committed_steps(), self._pointer(), lambda s: commit_order(self, s))

    def latest_step(self) -> int | None:
        """The newest step of the current timeline (the one ``latest`` names, unless the process
        died between writing a manifest and the pointer), or None."""
        timeline = self.timeline_steps()
        return timeline[-1] if timeline else None

    def newest_fencing_token(self) -> int:
        """The highest fencing token among the newest committed manifests (0 if none): a floor
        for a new lease, so tokens keep growing even if the lease folder was removed."""
        tokens = [(commit_order(self, s) or (0, 0.0))[0] for s in self.committed_steps()[-3:]]
        return max(tokens, default=0)

    # ----------------------------------------------------------------- loading
    def load_manifest(self, step: int) -> Manifest:
        where = f"{self.step_dir(step)}/{MANIFEST_NAME}"
        data = self.storage.try_read_bytes(Storage.join(self.step_rel(step), MANIFEST_NAME))
        if data is None:
            raise CheckpointNotFoundError(f"{where} does not exist: step {step} is not committed")
        manifest = Manifest.from_bytes(data, where)
        if manifest.step != step:
            raise CheckpointCorruptError(f"{where}: describes step {manifest.step}, not {step}")
        return manifest

    def role_files(self, step: int, role: str) -> list[FileRecord]:
        """The manifest's records of a role's files, relative to :meth:`role_dir`."""
        return self.load_manifest(step).files_under(role)

    def load_trainer_state(self, step: int) -> dict[str, Any]:
        """The controller state saved with ``step``, checked against the manifest."""
        manifest = self.load_manifest(step)
        rec = next((r for r in manifest.files if r.path == TRAINER_STATE_NAME), None)
        where = f"{self.step_dir(step)}/{TRAINER_STATE_NAME}"
        if rec is None:
            raise CheckpointNotFoundError(f"step {step} was committed without a {TRAINER_STATE_NAME}")
        data = self.storage.try_read_bytes(Storage.join(self.step_rel(step), TRAINER_STATE_NAME))
        if data is None:
            raise CheckpointCorruptError(f"{where}: file is missing")
        if len(data) != rec.size or hashlib.sha256(data).hexdigest() != rec.sha256:
            raise CheckpointCorruptError(f"{where}: size or sha256 differs from the manifest")
        try:
            state = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(state, dict):
            raise CheckpointCorruptError(f"{where}: expected a JSON object")
        return state

    # ----------------------------------------------------------------- verification
    def verify(self, step: int, deep: bool = True) -> str:
        """``"ok"``, ``"corrupt: <file>: <why>"`` or ``"uncommitted"``. Sizes are always
        checked; with ``deep`` every file is read and its sha256 compared."""
        present = self.storage.find(self.step_rel(step))
        if MANIFEST_NAME not in present:
            return "uncommitted"
        try:
            manifest = self.load_manifest(step)
        except CheckpointCorruptError as exc:
            return f"corrupt: {MANIFEST_NAME}: {exc}"
        return self.verifier.check(self.step_rel(step), manifest, present, deep)

    def find_latest_valid(self, deep: bool = True) -> int | None:
        """The newest committed step that verifies; each corrupt one on the way is reported
        through ``on_corrupt(step, reason)`` and logged. None when there is none."""
        for step in reversed(self.timeline_steps()):
            status = self.verify(step, deep=deep)
            if status == "ok":
                return step
            if status.startswith("corrupt"):
                log.error("checkpoint %s is %s; falling back to an earlier one", self.step_dir(step), status)
                if self.on_corrupt is not None:
                    self.on_corrupt(step, status)
        return None
