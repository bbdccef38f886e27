"""Unit tests of liveness: the progress tracker and the hung-rank decision, with a fake clock (no Ray)."""

from __future__ import annotations

import threading

import pytest

from resilient_rl.runtime import progress
from resilient_rl.runtime.dispatch import register
from resilient_rl.runtime.liveness import RankWatch, judge
from resilient_rl.runtime.progress import ProgressSnapshot, ProgressTracker
from resilient_rl.errors import WorkerTimeoutError
from resilient_rl.recovery.causes import classify
from resilient_rl.testing.clock import FakeClock


def test_tracker_reports_call_age_and_advances():
    clock = FakeClock(100.0)
    tr = ProgressTracker(clock=clock, sleep=clock.sleep)
    assert tr.snapshot() == ProgressSnapshot(None, 0.0, 0)
    tr.begin("update_actor")
    clock.now += 5
    assert tr.snapshot() == ProgressSnapshot("update_actor", 5.0, 0)
    tr.advance("mini-batch")
    clock.now += 1.5
    assert tr.snapshot() == ProgressSnapshot("update_actor", 1.5, 1)
    tr.end()
    assert tr.snapshot() == ProgressSnapshot(None, 0.0, 1)


def test_nested_calls_report_the_outer_one_and_context_manager_ends_on_error():
    tr = ProgressTracker()
    with pytest.raises(RuntimeError):
        with tr.track("actor_update_actor"):
            with tr.track("update_actor"):
                assert tr.snapshot().call == "actor_update_actor"
                raise RuntimeError("boom")
    assert tr.snapshot().call is None


def test_slow_down_sleeps_before_the_next_advances_only():
    clock = FakeClock(100.0)
    tr = ProgressTracker(clock=clock, sleep=clock.sleep)
    tr.slow_down(2.0, 2)
    for _ in range(3):
        tr.advance()
    assert clock.now == 104.0 and tr.snapshot().advances == 3
    with pytest.raises(ValueError, match="seconds_per_advance"):
        tr.slow_down(-1, 1)


def test_advances_from_threads_are_all_counted():
    tr = ProgressTracker()

    def work():
        for _ in range(1000):
            tr.advance()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Unlocked increments may race; the count only has to grow (liveness reads age, not the count).
    assert 1000 <= tr.snapshot().advances <= 4000


def test_register_marks_the_call_in_this_process():
    seen = []

    class W:
        @register()
        def work(self):
            seen.append(progress.snapshot().call)
            progress.advance("step")
            return 1

    assert W().work() == 1
    assert seen == ["work"] and progress.snapshot().call is None


def test_advancing_counts_one_advance_per_item():
    before = progress.snapshot().advances
    assert list(progress.advancing([b"a", b"b", b"c"], "chunk")) == [b"a", b"b", b"c"]
    assert progress.snapshot().advances == before + 3


def _w(call=None, age=0.0, sent_at=None, pid=7):
    return RankWatch(sent_at=sent_at, snapshot=ProgressSnapshot(call, age, 3) if call or age else None, pid=pid)


def test_a_long_call_that_advances_is_live():
    watches = {0: _w("update_actor", age=0.5), 1: _w("update_actor", age=2.9)}
    assert judge(watches, now=1000.0, hang_timeout_s=3.0, health_timeout_s=2.0) is None


def test_a_rank_inside_a_call_without_progress_is_stalled():
    watches = {0: _w("update_actor", age=0.5), 1: _w("update_actor", age=3.5, pid=42)}
    hung = judge(watches, now=1000.0, hang_timeout_s=3.0, health_timeout_s=2.0)
    assert (hung.rank, hung.kind, hung.pid, hung.stalled_s) == (1, "stalled", 42, 3.5)  # the hang's age: detect
    assert "update_actor" in hung.detail and "hang_timeout_s" in hung.detail


def test_an_idle_rank_is_never_stalled():
    assert judge({0: _w(None, age=999.0)}, now=5.0, hang_timeout_s=3.0, health_timeout_s=2.0) is None


def test_the_first_to_stop_is_named_when_its_peers_wait_on_it():
    # Rank 2 stopped advancing first; 0 and 1 stalled later in the collective waiting for it.
    watches = {0: _w("update", age=4.0), 1: _w("update", age=4.2), 2: _w("update", age=9.0)}
    assert judge(watches, now=0.0, hang_timeout_s=3.0, health_timeout_s=2.0).rank == 2


def test_an_unanswered_health_call_beats_stalled_peers():
    # A stopped rank cannot reply; its peer answers but waits in the collective.
    clock = FakeClock(50.0)
    watches = {0: _w("update", age=1.0, sent_at=clock.now), 1: _w("update", age=1.0)}
    assert judge(watches, clock(), 3.0, 2.0) is None
    clock.now += 2.5
    watches[1] = _w("update", age=3.5)
    hung = judge(watches, clock(), 3.0, 2.0)
    assert (hung.rank, hung.kind, hung.stalled_s) == (0, "unresponsive", 2.5)
    assert "health_timeout_s" in hung.detail


def test_a_hang_is_its_own_recoverable_cause():
    exc = WorkerTimeoutError("actor rank 1 is hung", role="actor", rank=1, cause="hang", pid=9, hang_kind="stalled")
    assert classify(exc).cause == "hang"
    assert classify(WorkerTimeoutError("ceiling", role="actor", rank=0, cause="timeout")).cause == "timeout"
    from resilient_rl.recovery.causes import RECOVERABLE_CAUSES

    assert "hang" in RECOVERABLE_CAUSES


def test_hang_timeout_is_validated_against_the_health_timeout():
    from resilient_rl.errors import ConfigError
    from resilient_rl.config.schema import load_config

    with pytest.raises(ConfigError, match="hang_timeout_s"):
        load_config(None, ["recovery.hang_timeout_s=1", "recovery.health_timeout_s=2"])
    assert load_config(None, []).recovery.hang_timeout_s > load_config(None, []).recovery.health_timeout_s


def test_a_process_still_warming_up_gets_warmup_timeout_s_to_answer():
    # Its start-up imports hold the interpreter for seconds on a loaded host; a stopped warm
    # process is still named after health_timeout_s.
    clock = FakeClock(50.0)
    watches = {0: RankWatch(sent_at=clock.now, pid=5, warming=True), 1: RankWatch(pid=6)}
    clock.now += 2.5
    assert judge(watches, clock(), 300.0, 2.0, warmup_timeout_s=30.0) is None
    hung = judge(watches, clock(), 300.0, 2.0)  # no warm-up allowance: judged as any rank
    assert (hung.rank, hung.kind) == (0, "unresponsive") and "health_timeout_s=2" in hung.detail
    clock.now += 28.0
    hung = judge(watches, clock(), 300.0, 2.0, warmup_timeout_s=30.0)
    assert (hung.rank, hung.kind, hung.pid, hung.stalled_s) == (0, "unresponsive", 5, 30.5)
    assert "while starting up" in hung.detail and "recovery.warmup_timeout_s=30" in hung.detail
    watches[1].sent_at = clock.now - 2.5
    watches[0].sent_at = None
    assert judge(watches, clock(), 300.0, 2.0, warmup_timeout_s=30.0).rank == 1


def test_the_rank_table_knows_which_processes_still_warm_up():
    from resilient_rl.runtime.group_ranks import RankTable
    from resilient_rl.runtime.worker import WorkerInfo

    table = RankTable.of(["h0", "h1"], ["a0", "a1"])
    shared = table.sharing()  # a colocated role group of the same processes
    assert [table.is_warming(r) for r in (0, 1)] == [True, True]  # not heard from: assumed starting
    table.note_placements([WorkerInfo(0, 2, None, 10, "n", warming=False),
                           WorkerInfo(1, 2, None, 11, "n", warming=True)])
    assert [shared.is_warming(r) for r in (0, 1)] == [False, True]
    table.serve(1, "spare", ("n", None), warming=False)  # a spare is ready only once warm
    assert shared.handles[1] == "spare" and not shared.is_warming(1)
    table.serve(0, "home")  # the bundle's own process again: unknown until it answers
    assert table.is_warming(0)

