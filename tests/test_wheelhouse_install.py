"""The air-gapped install of the README's "Deploying on a cluster": a folder of wheels filled where
pip reaches an index (``scripts/fill_wheelhouse.sh``), then ``./install.sh --wheelhouse DIR`` in a
fresh virtual environment with no index at all, torch taken from the folder too (a cluster that
brings its own torch skips that part)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient_rl.testing.bench_scripts import REPO

CPU_INDEX = os.environ.get("RRL_TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")


def run(args: list, **kwargs) -> str:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=REPO, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def add_cpu_torch(folder: Path) -> None:
    """This torch's CPU build and its own requirements, as install.sh takes them (the CPU index
    first, then the configured one)."""
    want = f"torch=={torch.__version__.split('+')[0]}"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(folder)]
    cpu = subprocess.run(pip + ["--timeout", "20", "--retries", "1", "--index-url", CPU_INDEX, want],
                         capture_output=True, timeout=900)
    if cpu.returncode != 0:
        run(pip + [want])


@pytest.mark.slow  # a package index, a fresh environment and every wheel installed: about two minutes
def test_a_filled_wheelhouse_installs_the_project_with_no_index(tmp_path):
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    out = run(["bash", "scripts/fill_wheelhouse.sh", wheels])
    assert f"for Python {sys.version_info[0]}.{sys.version_info[1]} in {wheels}" in out
    assert not list(wheels.glob("torch-*.whl"))  # left out: clusters bring their own CUDA build
    add_cpu_torch(wheels)
    run([sys.executable, "-m", "venv", venv])
    # No index and none of this machine's pip settings (its find-links and constraints): the folder alone.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv), PYTHONPATH="",
               PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    out = run(["./install.sh", "--wheelhouse", wheels], env=env)
    assert "installing from the wheelhouse" in out
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "check"], env=env)
    # What a rank imports, and the command's entry point, from the new environment.
    out = run([python, "-c", "import resilient_rl, resilient_rl.workers.roles, ray, tensordict, safetensors, torch; "
                             "print(resilient_rl.__file__, torch.__version__)"], env=env)
    assert out.startswith(str(REPO / "resilient_rl")), out
    assert "usage: resilient-rl" in run([venv / "bin" / "resilient-rl", "--help"], env=env)


def test_install_refuses_a_wheelhouse_that_is_not_a_folder(tmp_path):
    proc = subprocess.run(["./install.sh", "--wheelhouse", str(tmp_path / "missing")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"install.sh: --wheelhouse {tmp_path / 'missing'} is not a folder"
