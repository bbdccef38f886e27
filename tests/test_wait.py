"""The polling helper of the tests and the chaos suite (resilient_rl/testing/wait.py)."""

from __future__ import annotations

import pytest

from resilient_rl.testing.wait import WaitTimeout, wait_until


def test_returns_the_first_truthy_result():
    results = iter([None, 0, [], {"ready": True}, {"later": True}])
    assert wait_until(lambda: next(results), 10, interval_s=0.0) == {"ready": True}


def test_times_out_naming_what_was_awaited_and_the_last_result():
    calls = []

    def never() -> bool:
        calls.append(1)
        return False

    with pytest.raises(WaitTimeout, match=r"waiting for the moon \(last: False\)"):
        wait_until(never, 0.05, interval_s=0.01, message="the moon")
    assert len(calls) >= 2  # polled, and once more at the deadline
    assert issubclass(WaitTimeout, AssertionError)


def test_a_message_function_reports_the_state_at_the_timeout():
    state = {"exit": None}

    def not_yet() -> bool:
        state["exit"] = 3
        return False

    with pytest.raises(WaitTimeout, match=r"progress \(exit 3\)"):
        wait_until(not_yet, 0.01, interval_s=0.01, message=lambda: f"progress (exit {state['exit']})")


def test_ignored_errors_count_as_not_yet_and_others_propagate():
    attempts = iter([OSError("refused"), OSError("refused"), "up"])

    def server() -> str:
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    assert wait_until(server, 10, interval_s=0.0, ignore=(OSError,)) == "up"
    with pytest.raises(ValueError, match="broken"):
        wait_until(lambda: (_ for _ in ()).throw(ValueError("broken")), 10, ignore=(OSError,))
    with pytest.raises(WaitTimeout, match=r"last: OSError\('refused'\)"):
        wait_until(lambda: (_ for _ in ()).throw(OSError("refused")), 0.01, interval_s=0.01, ignore=(OSError,))
