"""The bench/ scripts as the tests run them: the folder they are imported from, and a script run
whole in a child process with no GPU visible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The repository's checkout: bench/ sits beside the package, not in it.
REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def run_on_cpu(script: str, *args: str, timeout: int = 600, **env_vars: str) -> subprocess.CompletedProcess:
    """``python bench/<script> args...`` with no GPU visible; the test's failure shows its stderr."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO), **env_vars}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
