"""Commands that only read a run folder start without importing torch or Ray.

``status``, ``plot`` and ``checkpoints list`` read JSON files; importing torch and Ray made each
take seconds. The check runs the real command line under ``python -X importtime`` and reads the
list of imported modules from it, so a heavy import anywhere on the path (a package
``__init__``, a module-level import) shows, whatever the machine's speed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient_rl.testing.run_folder import FakeRun

HEAVY = ("torch", "ray")


def imported_modules(*argv: str, cwd=None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime *argv``; the result and the names of the modules it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, names


def heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in HEAVY)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> FakeRun:
    """A run with checkpoints and a recovered failure, so every reader takes its full path."""
    fake = FakeRun(tmp_path_factory.mktemp("start"), "quick", total_steps=8)
    fake.train(4)
    fake.fail()
    fake.train(8)
    return fake


@pytest.mark.parametrize("command", ["status", "status --json", "plot", "checkpoints list"])
def test_a_command_that_reads_a_run_imports_neither_torch_nor_ray(run, command, tmp_path):
    words = command.split()
    if words[0] == "checkpoints":
        args = [*words, run.name, "--root", run.cfg.checkpoint.root]
    else:
        args = [*words, run.name, "--output-dir", run.cfg.trainer.output_dir]
    if words[0] == "plot":
        args += ["--out", str(tmp_path / "p.png")]
    proc, names = imported_modules("-m", "resilient_rl.cli", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resilient_rl.cli" in names or "resilient_rl" in names  # the parse saw the imports
    assert heavy(names) == [], f"{command} imported {heavy(names)[:5]}"


@pytest.mark.parametrize("module", ["resilient_rl", "resilient_rl.config", "resilient_rl.checkpoint",
                                    "resilient_rl.telemetry"])
def test_importing_a_package_imports_neither_torch_nor_ray(module):
    proc, names = imported_modules("-c", f"import {module}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert module in names
    assert heavy(names) == []


def test_the_verl_names_still_import_from_the_package():
    code = ("import sys, resilient_rl; from resilient_rl import DataProto, Worker, RayWorkerGroup, register; "
            "from resilient_rl.checkpoint import CheckpointManager, stage; from resilient_rl.config import load_config; "
            "assert 'torch' in sys.modules and DataProto.__module__ == 'resilient_rl.protocol'; "
            "assert set(resilient_rl.__all__) <= set(dir(resilient_rl)); "
            "from resilient_rl import *; print(RayResourcePool.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "RayResourcePool"


def test_an_unknown_name_is_an_attribute_error():
    import resilient_rl

    with pytest.raises(AttributeError, match="no_such_name"):
        resilient_rl.no_such_name  # noqa: B018


def test_the_start_bench_prints_each_command_against_python():
    bench = Path(__file__).resolve().parents[1] / "bench" / "cli_start.py"
    proc = subprocess.run([sys.executable, str(bench), "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any("resilient-rl status RUN" in line and "of python -c pass" in line for line in lines), proc.stdout
