"""A rank process's own log records (runtime/worker_logging.py): INFO to stdout, warnings to stderr,
each with its level and logger, so that Ray forwards them to the driver's ``train.log``; a process
whose logging is configured already is left as it is. Each case runs in a fresh interpreter, whose
logging is as Ray leaves a worker's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LOG = """
import logging
from resilient_rl.runtime.worker_logging import forward_package_logs
{before}
print("first", forward_package_logs(), "second", forward_package_logs(), flush=True)
logging.getLogger("resilient_rl.models.varlen").info("packed attention: split")
logging.getLogger("resilient_rl.runtime.worker").warning("rank 1 is slow")
logging.getLogger("elsewhere").info("not the package's")
"""


def run(before: str = "", **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", LOG.format(before=before)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_rank_process_writes_the_packages_info_to_stdout_and_warnings_to_stderr():
    proc = run()
    assert proc.stdout.splitlines() == ["first True second False",
                                        "INFO resilient_rl.models.varlen: packed attention: split"]
    assert proc.stderr.splitlines() == ["WARNING resilient_rl.runtime.worker: rank 1 is slow"]


@pytest.mark.parametrize("before, env, out, err", [
    ("", {"RRL_LOG_LEVEL": "warning"}, [], ["WARNING resilient_rl.runtime.worker: rank 1 is slow"]),
    # Logging configured by the process itself (a driver, a test run): left as it is.
    ("import sys; logging.basicConfig(stream=sys.stdout, format='%(name)s| %(message)s')", {},
     ["resilient_rl.runtime.worker| rank 1 is slow"], []),
])
def test_the_level_follows_rrl_log_level_and_configured_logging_is_kept(before, env, out, err):
    proc = run(before, **env)
    first, *lines = proc.stdout.splitlines()
    assert first == ("first True second False" if not before else "first False second False")
    assert lines == out and proc.stderr.splitlines() == err
