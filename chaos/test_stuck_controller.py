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

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

_CONTROLLER = """
import sys, time
import psutil, ray
from resilient_rl.runtime import health
from resilient_rl.trainer.preemption import Preemption

ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")

@ray.remote(num_cpus=0)
class Rank:
    pass

rank = Rank.remote()
ray.get(rank.__ray_ready__.remote())
node = ray.get_runtime_context().get_node_id()
p = Preemption(answer_within_s=2.0)
p.install(when_stuck=lambda: f"ended from the watch after {p.signal_name}", exit_code=143)
for child in psutil.Process().children(recursive=True):
    if "gcs_server" in " ".join(child.cmdline()):
        child.kill()
print("probes:", health._actor_record(rank), health.node_answers(node), flush=True)
print("reading", flush=True)
if sys.argv[1] == "acted on":
    while not p.requested:
        time.sleep(0.01)
ray.nodes()
print("returned", flush=True)
"""


@pytest.mark.parametrize("signal_is", ["acted on", "sent"])
def test_a_controller_stuck_in_a_read_from_a_gone_control_plane_ends_as_preempted(tmp_path, signal_is):
    """``acted on``: the handler runs, then the read blocks before the run's end is recorded;
    ``sent``: the signal lands as the read starts (before it, or inside it)."""
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER)
    # Its own session: Ray's processes join its process group, and are stopped with it below.
    proc = subprocess.Popen([sys.executable, str(script), signal_is], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        while not lines or lines[-1] != "reading\n":
            line = proc.stdout.readline()
            assert line, f"the controller ended early: {proc.wait(60)}, {lines} {proc.stderr.read()[-3000:]}"
            lines.append(line)
        assert lines[-2] == "probes: {} False\n"  # answered (nothing known) although the GCS is gone
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # past Ray's own end of it, 60 s after the GCS went
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 143, err[-3000:]  # not Ray's exit code 1, a minute later
    assert "returned" not in out
    assert "resilient-rl: ended from the watch after SIGTERM" in err
    assert "SIGTERM received, and the main thread stopped acting on signals (2 s without an answer)" in err
    assert "ray.nodes()" in err, err[-3000:]  # the stack names the call it is stuck in
