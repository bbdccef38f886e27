"""Retention as a run ages: a commit lists the run's top level once and asks for each step's
manifest, whatever the kept steps hold and however much ``abandoned/`` holds; and the timelines
set aside in ``abandoned/`` are kept as retention keeps steps, the newest ``keep_last`` of them."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.faults.storage import FaultPlan, faulty_url
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
        # The step's own folder (its files must be the ones reported), the run's names, and the
        # names in abandoned/ (one timeline, not more than keep_last: none of them is read).
        assert calls == [("find", f"run/step_{step:08d}"), ("ls", "run"), ("ls", "run/abandoned")]
    assert manager.committed_steps() == [2, 4, 5, 6] and manager.latest_step() == 6


OLD = ("20240101T000000Z-aaaaaa", "20240102T000000Z-bbbbbb", "20240103T000000Z-cccccc")


def _set_aside_long_ago(manager: CheckpointManager, stamp: str, step: int, note: bool = True) -> None:
    """A timeline a restore set aside at ``stamp``: a committed ``step`` and (``note``) its SET_ASIDE.json."""
    aside = CheckpointManager(manager.storage.url_for("run/abandoned"), stamp, keep_last=5, retry=FAST)
    save_step(aside, step)
    if note:
        at = time.mktime(time.strptime(stamp[:16], "%Y%m%dT%H%M%SZ")) - time.timezone
        aside.storage.write_bytes_atomic(f"{stamp}/SET_ASIDE.json", json.dumps({"at": at, "steps": [step]}).encode())


def test_a_commit_deletes_the_timelines_set_aside_but_the_newest_keep_last(tmp_path, caplog):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=2, retry=FAST)
    save_step(manager, 1)
    for i, stamp in enumerate(OLD):
        _set_aside_long_ago(manager, stamp, 10 + i, note=i > 0)  # the oldest, written by hand, has no note
    metrics = tmp_path / "run" / "abandoned" / "metrics-20240101T000000Z.jsonl"  # a run folder sharing the root
    metrics.write_text("{}\n")
    with caplog.at_level(logging.INFO, logger="resilient_rl.checkpoint.retention"):
        save_step(manager, 2)
    assert sorted(p.name for p in metrics.parent.iterdir()) == [*OLD[1:], metrics.name]
    [record] = [r for r in caplog.records if "set aside" in r.getMessage()]
    assert OLD[0] in record.getMessage() and "step(s) [10]" in record.getMessage()
    assert getattr(record, "rrl_file_only", False)  # train.log only, as retention of steps
    assert manager.committed_steps() == [1, 2]


def test_timelines_set_aside_since_the_newest_commit_are_kept(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=1, keep_every=2, retry=FAST)
    for step in (2, 4, 6):
        save_step(manager, step)
    _set_aside_long_ago(manager, OLD[0], 10)
    # Two restores, each to an earlier step, and no commit since: both timelines may be wanted back.
    assert manager.set_aside_newer(4, "restored step 4") == [6]
    assert manager.set_aside_newer(2, "restored step 2") == [4]
    notes = {json.loads((p / "SET_ASIDE.json").read_text()).get("reason"): p
             for p in (tmp_path / "run" / "abandoned").iterdir()}
    first, second = notes["restored step 4"], notes["restored step 2"]
    assert manager.prune_set_aside() == [OLD[0]]  # beyond keep_last=1 and older than step 2's commit
    assert sorted(p.name for p in (tmp_path / "run" / "abandoned").iterdir()) == sorted([first.name, second.name])
    save_step(manager, 3)  # now the run's newest commit is newer than both
    assert [p.name for p in (tmp_path / "run" / "abandoned").iterdir()] == [second.name]
    with listings(manager.storage) as calls:
        save_step(manager, 5)
    assert calls[2:] == [("ls", "run/abandoned")]  # pruned to keep_last: its one timeline is not read
    assert manager.committed_steps() == [2, 5]


def test_nothing_set_aside_is_deleted_before_the_run_commits(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", keep_last=1, retry=FAST)
    for stamp in OLD:
        _set_aside_long_ago(manager, stamp, 10)
    assert manager.prune_set_aside() == []
    assert len(list((tmp_path / "run" / "abandoned").iterdir())) == 3


def _note(manager: CheckpointManager, reason: str) -> str:
    """The folder in abandoned/ of the timeline set aside for ``reason``."""
    folder = manager.storage.url_for("run/abandoned")
    import pathlib

    return next(p.name for p in pathlib.Path(folder).iterdir()
                if json.loads((p / "SET_ASIDE.json").read_text()).get("reason") == reason)


def test_the_newest_timeline_is_the_one_set_aside_by_the_newest_lease_whatever_the_clocks(tmp_path, monkeypatch):
    """A controller whose clock ran ten minutes ahead set a timeline aside; the next one (a newer
    lease, a right clock) set another aside minutes later: that one is the newest and is kept."""
    import resilient_rl.checkpoint.retention as retention

    class Lease:
        def __init__(self, token):
            self.token = token

        def check(self):
            pass

    manager = CheckpointManager(str(tmp_path), "run", keep_last=1, keep_every=1, retry=FAST)
    for step in (1, 2, 3, 4):
        save_step(manager, step, world=1)
    now = time.time
    manager.lease = Lease(7)
    monkeypatch.setattr(retention.time, "time", lambda: now() + 600)
    manager.set_aside_newer(3, "ahead")
    monkeypatch.setattr(retention.time, "time", now)
    manager.lease = Lease(8)
    manager.set_aside_newer(2, "behind")
    newest = _note(manager, "behind")
    save_step(manager, 3, world=1)
    assert [p.name for p in (tmp_path / "run" / "abandoned").iterdir()] == [newest]


def test_a_set_aside_cut_short_is_kept_whole_with_the_rest_moved_by_the_next_controller(tmp_path, monkeypatch):
    """A controller dies between moving step 3 and step 4 aside; the next one, resumed from step 2
    again, moves the rest into a folder of its own. The two folders are one timeline: a commit
    with keep_last=1 keeps both (it deleted the first, and step 3 with it)."""
    manager = CheckpointManager(str(tmp_path), "run", keep_last=1, keep_every=1, retry=FAST)
    for step in (1, 2, 3, 4):
        save_step(manager, step, world=1)
    rename, moved = manager.storage.rename_local, []

    def die_after_one(src, dst):
        if moved:
            raise KeyboardInterrupt("killed")
        moved.append(src)
        return rename(src, dst)
    monkeypatch.setattr(manager.storage, "rename_local", die_after_one)
    with pytest.raises(KeyboardInterrupt):
        manager.set_aside_newer(2, "cut short")
    monkeypatch.undo()
    again = CheckpointManager(str(tmp_path), "run", keep_last=1, keep_every=1, retry=FAST)
    assert again.set_aside_newer(2, "the rest") == [4]
    save_step(again, 3, world=1)
    aside = tmp_path / "run" / "abandoned"
    assert sorted(p.name for folder in aside.iterdir() for p in folder.iterdir() if p.name.startswith("step_")) == [
        "step_00000003", "step_00000004"]


def test_a_timeline_set_aside_that_cannot_be_pruned_does_not_fail_the_commit(tmp_path, caplog):
    """Pruning abandoned/ is housekeeping: the step is committed (its manifest and ``latest``
    written) whatever it meets; it is tried again at the next commit."""
    manager = CheckpointManager(str(tmp_path), "run", keep_last=1, retry=FAST)
    save_step(manager, 1)
    for stamp in OLD[:2]:
        _set_aside_long_ago(manager, stamp, 10)
    url, options = faulty_url(str(tmp_path), FaultPlan(outage_reads="SET_ASIDE.json"), name=uuid.uuid4().hex)
    manager = CheckpointManager(url, "run", keep_last=1, storage_options=options, retry=FAST)
    with caplog.at_level(logging.WARNING):
        save_step(manager, 2)
    assert manager.committed_steps() == [2] and manager.latest_step() == 2  # step 1 past keep_last
    assert any("could not be pruned" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in (tmp_path / "run" / "abandoned").iterdir()) == list(OLD[:2])


def test_a_file_named_like_a_timeline_is_left_alone(tmp_path, caplog):
    """Only folders in abandoned/ are timelines: a file named like one is neither pruned nor,
    unreadable as a timeline, a warning at every commit."""
    manager = CheckpointManager(str(tmp_path), "run", keep_last=1, retry=FAST)
    save_step(manager, 1)
    for stamp in OLD[:2]:
        _set_aside_long_ago(manager, stamp, 10)
    (tmp_path / "run" / "abandoned" / OLD[2]).write_text("a file named as a timeline")
    with caplog.at_level(logging.WARNING):
        save_step(manager, 2)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in (tmp_path / "run" / "abandoned").iterdir()) == list(OLD[1:])
