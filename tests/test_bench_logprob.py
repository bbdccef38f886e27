"""bench/logprob.py on CPU, at a toy size: it runs every variant and reports the chunked log-probs
equal to the full-logits ones (nothing here reads its timings)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a fresh interpreter importing transformers; tests/test_chunked_logprob.py covers the maths
def test_logprob_bench_runs_on_cpu_and_reports_equal_log_probs():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "logprob.py"), "--batch", "2", "--prompt", "8",
                           "--response", "8", "--repeats", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:7]] == ["full", "chunked", "chunked+ckpt", "chunked+packed",
                                                        "chunked+head"]
    assert any(line.startswith("max |chunked+head - chunked| log-prob: ") for line in lines)
    assert lines[-1] == "max |chunked - full| log-prob: 0 (bit-identical)"


@pytest.mark.slow  # a fresh interpreter that compiles
def test_the_head_alone_is_timed_eager_compiled_per_chunk_and_as_its_matrix_products():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "logprob.py"), "--head-rows", "16", "--head-chunks",
                           "3", "--bf16", "--repeats", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("W")]  # the compiler's warnings
    assert lines[0] == ("the head: 3 chunk(s) of 16 rows x 4096 ids, hidden 64, forward + backward, cpu, "
                        "compute torch.bfloat16, fp32 weight")
    assert [line.split("  ")[1].strip() for line in lines[1:6]] == [
        "per-chunk F.linear", "per-chunk, compiled", "chunked head, eager", "chunked head, compiled",
        "matrix products alone"]
    # The weight's casts and its gradient's: per chunk before, per pass now.
    assert lines[6].startswith("  weight-sized writes, per-chunk F.linear: ")
    assert lines[7].startswith("  weight-sized writes, chunked head, eager: ")
    casts = [int(re.search(r"_to_copy (\d+)x", line).group(1)) for line in lines[6:8]]
    assert casts[0] > casts[1], lines[6:8]
