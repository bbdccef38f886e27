"""bench/gpu_figures.sh as a GPU machine would run it: the command lines it builds, in its order and
within its budget, each accepted by the script it calls. The shell script itself runs; ``python``,
``nvidia-smi`` and ``timeout`` are stand-ins that record what they were called with (``timeout``
then runs its command), and each recorded argument list goes through its script's own parser."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
from pathlib import Path

import pytest

from resilient_rl.testing.bench_scripts import BENCH

# One call a record: its arguments each ended by US (0x1f), the record by RS (0x1e), in $CALLS/<name>.
_RECORDER = """#!/bin/sh
log="$CALLS/$(basename "$0")"
for a in "$@"; do printf '%s\\037' "$a" >> "$log"; done
printf '\\036' >> "$log"
if [ "$(basename "$0")" = timeout ]; then shift 3; exec "$@"; fi
"""


def run_figures(tmp_path: Path, *args: str, budget: int | None = 0) -> tuple[subprocess.CompletedProcess, dict]:
    """``bash bench/gpu_figures.sh OUT args...`` with the stand-ins (``RRL_FIGURES_BUDGET=budget``,
    unset where None): its process, and each stand-in's calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name in ("python", "nvidia-smi", "timeout"):
        (bin_dir / name).write_text(_RECORDER)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)}
    env.pop("RRL_FIGURES_BUDGET", None)
    if budget is not None:
        env["RRL_FIGURES_BUDGET"] = str(budget)
    proc = subprocess.run(["bash", str(BENCH / "gpu_figures.sh"), str(tmp_path / "out"), *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    recorded = {f.name: [c.split("\x1f")[:-1] for c in f.read_text().split("\x1e")[:-1]] for f in calls.iterdir()}
    return proc, recorded


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parse(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """``argv`` through bench/<script>'s parser: its ``parse_args`` where it has one (with its own
    checks), else its ``main`` stopped right after argparse, so nothing is measured."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(Path(script).stem)
    if hasattr(module, "parse_args"):
        return module.parse_args(argv)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed) as parsed:
            module.main(argv)
    return parsed.value.namespace


def test_every_command_it_runs_is_accepted_by_its_script(tmp_path, monkeypatch):
    proc, calls = run_figures(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert calls["nvidia-smi"] == [["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]]
    versions, *benches = calls["python"]
    assert versions[0] == "-c" and "import torch, transformers, ray" in versions[1]
    # Every bench runs under a limit (its SIGKILL follows), with the same arguments.
    assert [c[4:] for c in calls["timeout"]] == benches
    # The figures still open first: the 1.5 B workload, then the 1.5 B update pass; what no target
    # needs after them, with what is left of a budget; the 0.5 B workload last.
    assert [c[0] for c in benches] == ["bench/gpu.py", "bench/update_mfu.py", "bench/gpu_release.py",
                                       "bench/snapshot_restore.py", "bench/fused_elementwise.py", "bench/gpu.py"]
    parsed = [parse(c[0], c[1:], monkeypatch) for c in benches]
    assert [parsed[0].workload, parsed[1].workload, parsed[-1].workload] == ["gsm8k-1.5b"] * 2 + ["gsm8k-0.5b"]
    assert parsed[0].size is None and parsed[-1].size is None  # the real shapes, not --tiny
    assert "hf_dynamic" in parsed[-1].generation_paths.split(",")  # the engine against HF generate
    assert parsed[3].device == parsed[4].device == "cuda"
    assert [name for name, _ in parsed[1].variant] == ["eager_elementwise", "compiled_blocks"]
    assert parsed[1].trace == str(tmp_path / "out" / "update_trace.json.gz")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    # The summary names each command before its lines and ends each with its exit status.
    assert [line for line in summary.splitlines() if line.startswith("== ")][2] == \
        "== python bench/gpu_release.py --gib 32 --repeats 2"
    assert summary.count("\n== ") + 1 == summary.count("rc=0") == len(benches)


def test_a_budget_cuts_each_limit_to_what_is_left_of_it(tmp_path):
    budget = 100
    proc, calls = run_figures(tmp_path, "gsm8k-1.5b", budget=budget)
    assert proc.returncode == 0, proc.stderr[-2000:]
    limits = [int(c[2]) for c in calls["timeout"]]
    assert len(limits) == 5
    # 25 s of the budget are kept for the last SIGKILL; no limit is under 5 s.
    assert all(5 <= limit <= budget - 25 for limit in limits), limits
    assert limits[1] == budget - 25  # the update pass's 200 s cut to the budget
    assert limits[2] == 40  # a short part is not cut while the budget has room for it


def test_without_a_budget_the_command_ends_within_eight_minutes(tmp_path, monkeypatch):
    """Both workloads' and the parts' own limits add up to about 17 minutes, more than a GPU
    session's device time: by default the whole command is bounded by 8 minutes. (The stand-ins
    take no time, so a part's limit longer than the bound shows it.)"""
    monkeypatch.setenv("RRL_FIGURE_TIMEOUT", "1000")
    proc, calls = run_figures(tmp_path, budget=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    limits = [int(c[2]) for c in calls["timeout"]]
    # The last limit is what is left of the bound after the others' (near-zero) time.
    assert len(limits) == 6 and limits[0] == 480 - 25 and all(limit <= 480 - 25 for limit in limits), limits


def test_an_unknown_workload_is_named_and_fails(tmp_path):
    proc, calls = run_figures(tmp_path, "gsm8k-7b")
    assert proc.returncode == 2 and "unknown workload gsm8k-7b (gsm8k-0.5b, gsm8k-1.5b)" in proc.stderr
    assert "bench/gpu.py" not in [c[0] for c in calls["python"]]
