"""Reads from Ray's control plane with a deadline (runtime/deadline_call.py): a read that does not
return (a control plane gone with the job) gives the caller its fallback instead of blocking it,
and no second thread piles up behind it."""

from __future__ import annotations

import threading

import pytest

from resilient_rl.runtime import deadline_call


def test_a_read_that_does_not_return_gives_its_fallback_and_blocks_no_later_caller():
    release, started = threading.Event(), []

    def hangs():
        started.append(1)
        release.wait(30)
        return ["late"]

    assert deadline_call.within("test-hangs", hangs, 0.05, otherwise=[]) == []
    assert deadline_call.within("test-hangs", hangs, 0.05, otherwise=[]) == []  # at once: no second read
    assert len(started) == 1
    assert deadline_call.within("test-other", lambda: 7, 5.0, otherwise=None) == 7  # other names are not held
    release.set()
    for _ in range(500):  # the blocked read ends: reads of that name run again
        if deadline_call.within("test-hangs", lambda: "answered", 5.0, otherwise=None) == "answered":
            break
        threading.Event().wait(0.01)
    else:
        pytest.fail("reads named test-hangs stayed held after the blocked one returned")


def test_a_read_that_answers_gives_its_value_or_its_error():
    assert deadline_call.within("test-answers", lambda: {"State": "ALIVE"}, 5.0, otherwise={}) == {"State": "ALIVE"}

    def fails():
        raise ConnectionError("the control plane refused")

    with pytest.raises(ConnectionError, match="refused"):
        deadline_call.within("test-answers", fails, 5.0, otherwise={})
    assert deadline_call.within("test-answers", lambda: 1, 5.0, otherwise=0) == 1


def test_concurrent_reads_of_one_name_each_get_their_answer():
    gate = threading.Barrier(4)
    answers = []

    def reader(i):
        answers.append(deadline_call.within("test-concurrent", lambda: (gate.wait(5), i)[1], 10.0, otherwise=None))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [0, 1, 2, 3]
