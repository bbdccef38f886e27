"""The README's "Porting a verl worker" example runs as it is written.

It is what a verl user copies first, so a missing import or a missing ``ray.init()`` fails them
before anything else does. The block is cut out of README.md and run in a Python process of its
own: it starts (and shuts down) its own local Ray cluster, as a user's script would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]


def readme_block(heading: str) -> str:
    """The first ```python block under the README's ``## heading``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"README.md's '{heading}' section has no python block"
    return match.group(1)


def test_the_verl_worker_example_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_block("Porting a verl worker"), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # Its ray.init() starts a local cluster: not one this shell points at, nor the one a `ray start`
    # on this machine recorded in /tmp/ray/ray_current_cluster (ray.init() with no address joins that).
    env["RAY_ADDRESS"] = "local"
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    # DP_COMPUTE_PROTO split 5 rows over 2 ranks (padded to 6), doubled them and unpadded the result.
    assert "tensor([0., 2., 4., 6., 8.])" in done.stdout, done.stdout[-2000:]
