"""What a commit costs the storage as a run ages: it lists the run's top level once and asks for
each step's manifest, whatever the kept steps hold and however much ``abandoned/`` holds."""

from __future__ import annotations

import pytest

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.testing.checkpoint_store import FAST, checkpoint_root, listings, save_step


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_commit_lists_the_run_once_and_neither_the_shards_nor_abandoned(kind, tmp_path, moto):
    root, options = checkpoint_root(kind, tmp_path, moto)
    manager = CheckpointManager(root, "run", keep_last=2, keep_every=2, storage_options=options, retry=FAST)
    for step in range(1, 8):
        save_step(manager, step)
    assert manager.set_aside_newer(4, "resumed from step 4") == [6, 7]  # abandoned/ holds their shards
    for step in (5, 6):
        files = save_step(manager, step, commit=False)
        with listings(manager.storage) as calls:
            manager.commit(step, files, {"actor": 2})
        # The step's own folder (its files must be the ones reported), then the run's names.
        assert calls == [("find", f"run/step_{step:08d}"), ("ls", "run")]
    assert manager.committed_steps() == [2, 4, 5, 6] and manager.latest_step() == 6
