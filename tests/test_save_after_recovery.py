"""Which restored step a recovery saves before the run goes on (``fit_loop.save_after_recovery``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from resilient_rl.trainer.fit_loop import save_after_recovery


def _trainer(step: int, last_committed: int | None, save_every: int = 2, pending=None, checkpoints_on=True):
    ckpt = SimpleNamespace(pending=pending, last_committed=last_committed,
                           due=lambda s: s % save_every == 0 or s == 6)
    return SimpleNamespace(step=step, ckpt=ckpt, checkpoints_on=checkpoints_on)


@pytest.mark.parametrize("step, last_committed, in_flight, saved", [
    (2, None, 2, True),    # restored from the snapshot of the due step whose save was abandoned
    (3, None, 2, True),    # restored past the abandoned save (a newer snapshot): step 2 would be lost
    (3, 2, None, False),   # nothing abandoned, step 3 not due: the schedule goes on
    (3, 2, 2, False),      # the save in flight committed before the failure was handled
    (1, None, 2, False),   # restored before the abandoned step: the replay saves it when due again
    (4, 4, 4, False),      # already committed
    (6, 4, None, True),    # the last step, not committed: the run is not done before it is
    (0, None, None, False),
])
def test_the_restored_step_is_saved_when_a_save_would_be_lost(step, last_committed, in_flight, saved):
    assert save_after_recovery(_trainer(step, last_committed), in_flight) is saved


def test_nothing_is_saved_with_a_save_still_pending_or_checkpoints_off():
    assert not save_after_recovery(_trainer(3, None, pending={"step": 3}), 2)
    assert not save_after_recovery(_trainer(3, None, checkpoints_on=False), 2)


def test_the_chaos_invariant_expects_the_restored_step_in_place_of_the_save_it_abandoned():
    from resilient_rl.faults.harness import RunResult, expected_checkpoints

    def result(*events):
        return RunResult("r", [], list(events), {}, {}, [], None, {}, set(), "", 0.0)

    abandoned = {"event": "checkpoint_abandoned", "step": 2}
    assert expected_checkpoints(result(abandoned, {"event": "recovered", "restored_step": 3}), [2, 4, 6]) == [3, 4, 6]
    # restored to the abandoned step or before it: that step is saved again, the same checkpoints
    assert expected_checkpoints(result(abandoned, {"event": "recovered", "restored_step": 2}), [2, 4, 6]) == [2, 4, 6]
    # a save the fault-free run no longer keeps: the replacement is gone by the end as well
    assert expected_checkpoints(result(abandoned, {"event": "recovered", "restored_step": 3}), [4, 6, 8]) == [4, 6, 8]
    assert expected_checkpoints(result({"event": "recovered", "restored_step": 3}), [2, 4, 6]) == [2, 4, 6]
