"""Where a run's time goes: useful and lost seconds, goodput and ETTR across controllers (fake clocks)."""

from __future__ import annotations

import json

import pytest

from resilient_rl.testing.clock import FakeClock
from resilient_rl.telemetry.goodput import UsefulTime
from resilient_rl.telemetry.training_time import LEDGER_NAME, TrainingTime, read_ledger


def controller(path, previous_state=None, start=1000.0, wall=1.7e9):
    clock, wall_clock = FakeClock(start), FakeClock(wall)
    lost: list[tuple[str, float]] = []
    t = TrainingTime(path, previous_state, on_lost=lambda c, s: lost.append((c, s)), clock=clock,
                     wall_clock=wall_clock, write_interval_s=0.0)
    return t, clock, wall_clock, lost


def run_steps(t, clock, wall_clock, steps, seconds=1.0):
    for step in steps:
        clock.advance(seconds)
        wall_clock.advance(seconds)
        t.step_done(step, seconds)


def test_goodput_and_ettr_fall_while_a_step_hangs(tmp_path):
    t, clock, wall, _ = controller(tmp_path)
    assert t.ettr() is None and t.goodput() is None  # not started: the gauges are absent
    t.start()
    clock.advance(2.0)  # workers starting: not useful
    t.steps_resume()
    run_steps(t, clock, wall, range(1, 9))
    assert t.ettr() == pytest.approx(8 / 10)
    clock.advance(1.5)  # a step in flight, as long as usual: still counted
    assert t.ettr() == pytest.approx(9.5 / 11.5)
    clock.advance(100.0)  # it hangs: credited for at most twice the slowest recent step
    assert t.ettr() == pytest.approx(10 / 111.5) and t.goodput() == pytest.approx(10 / 111.5)


def test_a_failure_loses_the_failed_work_the_recovery_and_the_rolled_back_steps(tmp_path):
    t, clock, wall, lost = controller(tmp_path)
    t.start()
    t.steps_resume()
    run_steps(t, clock, wall, range(1, 6))  # steps 1..5, 1 s each
    clock.advance(0.5)  # step 6 half done when a worker dies
    t.failed("died")
    clock.advance(4.0)  # the recovery
    t.recovered(failed_step=6, restored_step=4)  # step 5 is rolled back
    assert lost == [("died", 0.5), ("died", 4.0), ("died", 1.0)]
    assert t.useful.total == 4.0
    clock.advance(1.0)
    assert t.step_done(5, 1.0) is None  # a lost step replayed: useful again, not the failed one yet
    clock.advance(1.0)
    assert t.step_done(6, 1.0) == pytest.approx(2.0)  # the failed step is done: the replay phase
    assert t.useful.total == 6.0 and sum(s for _, s in lost) == pytest.approx(5.5)
    assert t.ettr() == pytest.approx(6.0 / 11.5)
    assert t.step_done(7, 0.0) is None  # the replay was reported once


def test_ettr_spans_controllers_and_a_crash_loses_the_pause_and_the_retrained_steps(tmp_path):
    a, clock, wall, _ = controller(tmp_path)
    a.start()
    a.steps_resume()
    run_steps(a, clock, wall, range(1, 11))  # 10 useful seconds of 10 (written at every step)
    ledger = read_ledger(tmp_path)
    assert ledger["wall_s"] == pytest.approx(10.0) and ledger["useful"][-1] == (10, 10.0)
    # a crashes (SIGKILL: no close); controller.json still says running. b starts 30 s later.
    b, clock_b, wall_b, lost = controller(tmp_path, previous_state="running", wall=wall.now + 30.0)
    b.start()
    assert lost == [("controller", 30.0)]
    clock_b.advance(2.0)
    b.steps_resume()
    assert b.ettr() == pytest.approx(10.0 / 42.0)  # not 1.0: the run's whole life
    # b resumed the checkpoint of step 8: its first step is 9, so a's steps 9 and 10 are lost
    run_steps(b, clock_b, wall_b, [9])
    assert lost[-1] == ("controller", 2.0)
    assert b.useful.total == 9.0 and b.ettr() == pytest.approx(9.0 / 43.0)
    assert b.goodput() == pytest.approx(1.0 / 3.0)  # this controller: one useful second of three
    b.close()
    assert read_ledger(tmp_path)["lost_s"] == {"controller": 32.0}


@pytest.mark.parametrize("state", ["finished", "interrupted"])
def test_the_pause_after_a_clean_stop_is_not_part_of_the_run(tmp_path, state):
    a, clock, wall, _ = controller(tmp_path)
    a.start()
    a.steps_resume()
    run_steps(a, clock, wall, range(1, 5))
    a.close()
    b, _, _, lost = controller(tmp_path, previous_state=state, wall=wall.now + 86400.0)
    b.start()
    assert lost == [] and b.ettr() == pytest.approx(1.0)


def test_an_aborted_recovery_is_lost_when_the_controller_stops(tmp_path):
    t, clock, wall, lost = controller(tmp_path)
    t.start()
    t.steps_resume()
    run_steps(t, clock, wall, [1])
    t.failed("hang")
    clock.advance(7.0)
    t.close()
    assert lost == [("hang", 7.0)] and read_ledger(tmp_path)["lost_s"] == {"hang": 7.0}


def test_an_unreadable_ledger_is_reported_and_accounting_starts_over(tmp_path, caplog):
    (tmp_path / LEDGER_NAME).write_text('{"version": 1, "wall_s": ')
    t, _, _, _ = controller(tmp_path, previous_state="running")
    assert LEDGER_NAME in caplog.text and "unreadable" in caplog.text
    t.start()
    t.steps_resume()
    assert t.wall_before == 0.0 and json.loads((tmp_path / LEDGER_NAME).read_text())["version"] == 1


def test_a_controller_whose_workers_never_start_leaves_the_ledger_alone(tmp_path):
    """A second controller refused by the run's lease starts its exporter first: it must not
    overwrite the live controller's ledger."""
    live, clock, wall, _ = controller(tmp_path)
    live.start()
    live.steps_resume()
    run_steps(live, clock, wall, range(1, 4))
    written = (tmp_path / LEDGER_NAME).read_text()
    refused, _, _, _ = controller(tmp_path, previous_state="running", wall=wall.now + 5.0)
    refused.start()
    refused.close()
    assert (tmp_path / LEDGER_NAME).read_text() == written


def test_useful_time_seeded_from_a_tail_rolls_back_inside_and_beyond_it():
    u = UsefulTime()
    u.seed([(100, 50.0), (101, 51.0), (102, 52.5)])
    assert u.total == 52.5 and u.tail(2) == [(101, 51.0), (102, 52.5)]
    assert u.rollback(101) == pytest.approx(1.5) and u.total == 51.0
    assert u.record(102, 2.0) == 0.0 and u.total == 53.0
    # older than the tail: estimated as if the steps before it took equal time
    assert u.rollback(40) == pytest.approx(53.0 - 20.0) and u.total == pytest.approx(20.0)
    assert u.record(41, 1.0) == 0.0 and u.total == pytest.approx(21.0)
