"""A controller process stuck in a read from Ray's control plane once it is gone, for
``chaos/test_stuck_controller.py`` and ``bench/stuck_controller.py``.

    python -m resilient_rl.testing.stuck_controller {sent,acted on} [ANSWER_WITHIN_S | none]

It starts a local Ray cluster, installs the preemption handlers with the signal watch (none: the
handlers alone, as before the watch), kills the cluster's GCS, prints what the recovery's probes
answer, then ``reading`` and calls ``ray.nodes()``, which blocks until Ray ends the process 60 s
after the GCS went (exit code 1). With ``acted on`` it first waits for the preemption signal to be
handled, so the read starts after it. :func:`start` runs it in a session of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import ray

from resilient_rl.runtime import health
from resilient_rl.trainer.preemption import Preemption


def start(mode: str, answer_within: str | None = None) -> subprocess.Popen:
    """This module's controller in a session of its own: Ray's processes join its process group,
    to be stopped with it (:func:`stop`)."""
    return subprocess.Popen([sys.executable, "-m", "resilient_rl.testing.stuck_controller", mode,
                             *([answer_within] if answer_within else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def until_reading(proc: subprocess.Popen) -> list[str]:
    """Its lines up to ``reading`` (the read that blocks comes next)."""
    lines = []
    while not lines or lines[-1] != "reading\n":
        line = proc.stdout.readline()
        assert line, f"the controller ended early: {proc.wait(60)}, {lines} {proc.stderr.read()[-3000:]}"
        lines.append(line)
    return lines


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the controller's process group (it and the Ray cluster it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str]) -> None:
    mode = argv[0]
    within = argv[1] if len(argv) > 1 else None
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Rank:
        pass

    rank = Rank.remote()
    ray.get(rank.__ray_ready__.remote())
    node = ray.get_runtime_context().get_node_id()
    p = Preemption(**({} if within in (None, "none") else {"answer_within_s": float(within)}))
    p.install(when_stuck=None if within == "none" else lambda: f"ended from the watch after {p.signal_name}",
              exit_code=143)
    for child in psutil.Process().children(recursive=True):
        if "gcs_server" in " ".join(child.cmdline()):
            child.kill()
    print("probes:", health._actor_record(rank), health.node_answers(node), flush=True)
    print("reading", flush=True)
    if mode == "acted on":
        while not p.requested:
            time.sleep(0.01)
    ray.nodes()
    print("returned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
