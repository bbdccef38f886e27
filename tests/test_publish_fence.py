"""A write is fenced as the last step before it is published, not before its fsync.

The fsync of a checkpoint file takes seconds on network storage. A lease check (or the check that a
step was not committed by a later save) made before it leaves those seconds for another controller to
take the run over, and the stale write is renamed into place anyway. Each test changes the world during
the fsync of one write (the local write path's ``os.fsync``, or the flush of a temp file on a
filesystem written by temp name and rename) and asserts that the write is not published.
"""

from __future__ import annotations

import contextlib

import pytest

from resilient_rl.checkpoint import CheckpointManager, Storage, stage, write_shard
from resilient_rl.checkpoint.leases.run_lease import RunLease
from resilient_rl.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME
from resilient_rl.checkpoint.write_guard import not_committed
from resilient_rl.errors import LeaseLostError, StaleWriteError
from resilient_rl.faults.storage import FaultPlan, after_local_fsync, faulty_url
from resilient_rl.testing.checkpoint_store import FAST, save_step, step_state
from resilient_rl.testing.clock import FakeClock


class _DuringFlush:
    """Runs ``action`` once, when the first write of a file whose path contains ``marker`` has its
    content flushed to storage and is about to take its name."""

    def __init__(self, kind: str, storage: Storage):
        self.kind, self.storage = kind, storage
        self.marker, self.action, self.fired = "", None, False

    def arm(self, marker: str, action) -> None:
        self.marker, self.action, self.fired = marker, action, False

    def _hook(self, path: str) -> None:
        if self.action is not None and not self.fired and self.marker in path:
            self.fired = True  # before acting: the action writes files of its own
            self.action()

    @contextlib.contextmanager
    def installed(self):
        if self.kind == "local":
            with after_local_fsync(self._hook):
                yield
        else:
            self.storage.fs.on_flush = self._hook
            try:
                yield
            finally:
                self.storage.fs.on_flush = None


def _root(kind: str, tmp_path) -> tuple[str, dict | None]:
    if kind == "local":
        return str(tmp_path / "ckpt"), None
    # Temp name + rename through the wrapper: the flush of the temp file, then the rename.
    return faulty_url(str(tmp_path / "ckpt"), FaultPlan(), name=f"fence-{tmp_path.name}")


def _published(manager: CheckpointManager, step: int) -> tuple[bool, str | None]:
    pointer = manager.storage.try_read_bytes(Storage.join(manager.run_name, LATEST_NAME))
    return manager.is_committed(step), pointer.decode() if pointer is not None else None


def _temp_files(manager: CheckpointManager) -> list[str]:
    return [p for p in manager.storage.find(manager.run_name) if ".tmp-" in p]


def _old_and_takeover(kind, tmp_path):
    """A controller holding the run with step 2 committed, and a takeover to trigger during a write."""
    root, options = _root(kind, tmp_path)
    clock = FakeClock(1_800_000_000.0)
    old = CheckpointManager(root, "run", keep_last=5, storage_options=options, retry=FAST)
    old.lease = RunLease(old.storage, "run", ttl_s=60, renew_s=20, clock=clock)
    old.lease.acquire()
    save_step(old, 2)
    new_lease = RunLease(Storage(root, options, FAST), "run", ttl_s=60, renew_s=20, clock=clock, takeover=True)
    return old, new_lease


@pytest.mark.parametrize("kind", ["local", "rename"])
@pytest.mark.parametrize("written, published", [
    # Lost during the manifest's write: step 4 is not committed (before the fix it was, and latest named it).
    (f"step_00000004/{MANIFEST_NAME}", (False, "step_00000002")),
    # Lost during the pointer's write: the manifest (published while the lease was held) stays; the pointer stays.
    (f"run/{LATEST_NAME}", (True, "step_00000002"))])
def test_a_lease_lost_during_a_commit_file_s_fsync_publishes_nothing_after_it(kind, written, published, tmp_path):
    old, new_lease = _old_and_takeover(kind, tmp_path)
    files = save_step(old, 4, commit=False)
    flush = _DuringFlush(kind, old.storage)
    flush.arm(written, new_lease.acquire)
    with flush.installed(), pytest.raises(LeaseLostError, match=new_lease.holder):
        old.commit(4, files, {"actor": 2})
    assert flush.fired, f"the takeover did not happen during the write of {written}"
    assert _published(old, 4) == published
    assert _temp_files(old) == []
    new_lease.close()


@pytest.mark.parametrize("kind", ["local", "rename"])
def test_a_step_committed_during_a_stale_shard_fsync_keeps_its_shard(kind, tmp_path):
    root, options = _root(kind, tmp_path)
    manager = CheckpointManager(root, "run", keep_last=5, storage_options=options, retry=FAST)
    role_dir = "run/step_00000004/actor"
    flush = _DuringFlush(kind, manager.storage)
    # The writer of an abandoned save of step 4 (generation 1) is in its fsync when the new
    # generation saves step 4 again and commits it.
    flush.arm("step_00000004/actor/shard_00000.safetensors", lambda: save_step(manager, 4))
    staged = stage(step_state(99, 0), 0, world_size=2, rank_local=("rng",))
    with flush.installed(), pytest.raises(StaleWriteError, match="generation 1"):
        write_shard(staged, manager.storage, role_dir, 0, guard=not_committed(manager.storage, role_dir, 1))
    assert flush.fired
    # Deep verification hashes every file: before the fix the stale shard replaced the committed one.
    assert manager.verify(4) == "ok"
    assert _temp_files(manager) == []
