"""A shard write never replaces a file of a committed step.

After a recovery, a surviving rank's background writer may still be writing the save that was
abandoned; the step can be saved again by the new generation and committed before the old write
finishes. The old write must then not rename its file over the committed one (the manifest's
checksum would no longer match, and the checkpoint would read as corrupt). So every shard write
carries the generation it belongs to and checks, as the last step before each of its files takes
its name (after the file's fsync, which can take seconds on network storage: a check before it
would let a commit landing meanwhile be overwritten), that the step has no manifest yet (see
``before_publish`` in :mod:`~resilient_rl.checkpoint.storage`); a commit in turn hashes what it lists
(``CheckpointManager.commit``), which catches a stale file that landed before the commit.
"""

from __future__ import annotations

from typing import Callable

from resilient_rl.checkpoint.manifest import MANIFEST_NAME
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.errors import StaleWriteError


def not_committed(storage: Storage, dir_path: str, generation: int | None) -> Callable[[], None]:
    """A guard for :func:`~resilient_rl.checkpoint.sharded.write_shard` into ``dir_path``
    (``{run}/step_N/{role}``): raises StaleWriteError once ``step_N`` holds a manifest."""
    step_rel = dir_path.rstrip("/").rsplit("/", 1)[0]
    manifest = Storage.join(step_rel, MANIFEST_NAME)

    def guard() -> None:
        if storage.exists(manifest):
            raise StaleWriteError(
                f"{storage.url_for(dir_path)}: the step was committed by another save while this write "
                f"(generation {generation}) was in flight; its file is dropped, the committed one kept")

    return guard
