"""A controller stuck in a call into Ray's control plane, which went down with the job, still ends
its run as preempted.

Ray's GCS is killed under a controller process, which then reads from it: the recovery's own
probes answer within their deadline (runtime/deadline_call.py), and a read with no deadline
(``ray.nodes()``) blocks the main thread until Ray ends the process, 60 s later with exit code 1,
no signal handler running meanwhile. The SIGTERM sent then, whether the main thread acted on it
before the read or not, must end the process with 143 within seconds, from the thread that
watches signals (trainer/signal_watch.py), naming where the main thread was stuck. The trainer's whole path under this fault is in test_preemption_signals.py
(``controller last``).
"""

from __future__ import annotations

import signal

import pytest

from resilient_rl.testing.stuck_controller import start, stop, until_reading

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("signal_is", ["acted on", "sent"])
def test_a_controller_stuck_in_a_read_from_a_gone_control_plane_ends_as_preempted(signal_is):
    """``acted on``: the handler runs, then the read blocks before the run's end is recorded;
    ``sent``: the signal lands as the read starts (before it, or inside it)."""
    proc = start(signal_is, "2")
    try:
        lines = until_reading(proc)
        assert lines[-2] == "probes: {} False\n"  # answered (nothing known) although the GCS is gone
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # past Ray's own end of it, 60 s after the GCS went
    finally:
        stop(proc)
    assert proc.returncode == 143, err[-3000:]  # not Ray's exit code 1, a minute later
    assert "returned" not in out
    assert "resilient-rl: ended from the watch after SIGTERM" in err
    assert "SIGTERM received, and the main thread stopped acting on signals (2 s without an answer)" in err
    assert "ray.nodes()" in err, err[-3000:]  # the stack names the call it is stuck in
