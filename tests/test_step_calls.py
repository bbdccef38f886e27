"""Calls of a step in flight together (trainer/step.py, trainer/pool.py): their phases' times and
the names a pool accepts. The Ray pools run them in tests/test_trainer_ray.py, where a step on
worker groups must equal the single-process one."""

from __future__ import annotations

import pytest

from resilient_rl.errors import RRLError
from resilient_rl.trainer import step as step_module
from resilient_rl.runtime.pool import STEP_CALLS, step_role
from resilient_rl.trainer.step import PhaseTimer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_phase_is_charged_from_the_previous_result_to_its_own(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_module.time, "perf_counter", clock)
    timer = PhaseTimer()
    arrivals = {"ref": 3.0, "old_log_prob": 1.0, "values": 2.0}  # seconds after the one before

    def results():
        clock.now += 0.5  # dispatching every call: charged to the first phase
        for phase, wait in arrivals.items():
            clock.now += wait
            yield f"{phase} result"

    handled = []
    for phase, result in timer.each(list(arrivals), results):
        handled.append((phase, result))
        clock.now += 0.25  # handling a result is charged to its phase
    assert handled == [(p, f"{p} result") for p in arrivals]
    assert timer.durations == {"ref": 3.75, "old_log_prob": 1.25, "values": 2.25}
    assert sum(timer.durations.values()) == clock.now - 100.0  # the phases add up to the wall time


def test_a_failed_call_charges_nothing_to_the_phases_after_it(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_module.time, "perf_counter", clock)
    timer = PhaseTimer()

    def results():
        clock.now += 1.0
        yield "ok"
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        for _ in timer.each(["update_critic", "update_actor"], results):
            pass
    assert timer.durations == {"update_critic": 1.0}


def test_step_calls_name_their_role_and_anything_else_is_refused():
    assert {m: step_role(m) for m in STEP_CALLS} == STEP_CALLS
    assert step_role("update_critic") == "critic" and step_role("compute_ref_log_prob") == "ref"
    with pytest.raises(RRLError, match="'generate_sequences' is not a step call"):
        step_role("generate_sequences")
