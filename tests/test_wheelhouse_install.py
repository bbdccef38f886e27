"""The air-gapped install of the README's "Deploying on a cluster": a folder of wheels filled where
pip reaches an index (``scripts/fill_wheelhouse.sh``), then ``./install.sh --wheelhouse DIR`` in a
fresh virtual environment with no index at all, torch taken from the folder too (a cluster that
brings its own torch skips that part)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
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


def test_the_wheelhouse_takes_the_extras_it_is_asked_for(tmp_path):
    """The README's air-gapped cluster runs a Hugging Face model with s3:// checkpoints: the
    wheelhouse must hold the hf and s3 extras' requirements when asked, and nothing else."""
    folder = tmp_path / "wheels"
    script = ["bash", "scripts/fill_wheelhouse.sh", folder]
    plain = run([*script, "--print-requirements"]).split()
    with_extras = run([*script, "--extras", "hf,s3", "--print-requirements"]).split()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not set(extras["hf"] + extras["s3"]) & set(plain)
    assert with_extras == plain + extras["hf"] + extras["s3"]
    # --dev is the dev extra; a requirement two extras share is listed once.
    both = run([*script, "--extras=s3", "--dev", "--print-requirements"]).split()
    assert both == plain + extras["s3"] + [r for r in extras["dev"] if r not in extras["s3"]]
    assert not any(r.startswith("torch") for r in with_extras)  # clusters bring their own
    bad = subprocess.run(["bash", "scripts/fill_wheelhouse.sh", folder, "--extras", "hf,s4"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'s4' is not an extra of pyproject.toml" in bad.stderr
    assert not folder.exists()  # nothing fetched, nothing written


@pytest.mark.slow  # a package index, a fresh environment and every wheel installed: about two minutes
def test_a_filled_wheelhouse_installs_the_project_with_no_index(tmp_path):
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    out = run(["bash", "scripts/fill_wheelhouse.sh", wheels, "--extras", "hf,s3"])
    assert f"for Python {sys.version_info[0]}.{sys.version_info[1]} in {wheels}" in out
    assert not list(wheels.glob("torch-*.whl"))  # left out: clusters bring their own CUDA build
    add_cpu_torch(wheels)
    run([sys.executable, "-m", "venv", venv])
    # No index and none of this machine's pip settings (its find-links and constraints): the folder alone.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv), PYTHONPATH="",
               PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    out = run(["./install.sh", "--wheelhouse", wheels, "hf,s3"], env=env)
    assert "installing from the wheelhouse" in out
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "check"], env=env)
    # What a rank imports (the hf and s3 extras too), and the command's entry point, from the new environment.
    out = run([python, "-c", "import resilient_rl, resilient_rl.workers.roles, ray, tensordict, safetensors, torch; "
                             "import transformers, s3fs; "
                             "print(resilient_rl.__file__, torch.__version__)"], env=env)
    assert out.startswith(str(REPO / "resilient_rl")), out
    assert "usage: resilient-rl" in run([venv / "bin" / "resilient-rl", "--help"], env=env)


def test_install_refuses_a_wheelhouse_that_is_not_a_folder(tmp_path):
    proc = subprocess.run(["./install.sh", "--wheelhouse", str(tmp_path / "missing")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"install.sh: --wheelhouse {tmp_path / 'missing'} is not a folder"
